"""The native decode step's batch, kept from one step to the next instead of rebuilt.

A step of running decodes is mostly the previous step again, each row one token longer. The
native layers (kernels/cpu_decode.cpp) read row t's context as the first positions[t] + 1 entries
of row t of one slot table, so the table is kept across steps: a row is refreshed only when its
request gained a page (once every page_size steps), and the table is rebuilt only when the
batch's requests change. What is left per step is two small tensors (token ids, positions) built
from Python lists: no ForwardBatch, no [rows, context] padding or mask.
"""

from __future__ import annotations

import torch

from dsaserve.engine.request import Req
from dsaserve.engine.scheduler import ScheduledBatch


def all_decodes(scheduled: ScheduledBatch) -> bool:
    """Every request of the step computes the last token of its fill (a decode: not a one-token
    chunk inside its prompt), so every row is sampled."""
    if scheduled.input_ids is not None:
        return False
    rows = zip(scheduled.reqs, scheduled.starts, scheduled.ends)
    return all(end - start == 1 and end == req.fill_len for req, start, end in rows)


class DecodeRows:
    def __init__(self) -> None:
        self.reqs: list[Req] = []
        self.table = torch.zeros(0, 0, dtype=torch.long)  # [rows, width]: each row's slots
        # the slot tensor each row was copied from: the scheduler replaces a request's
        # `slots` whenever they change (a new page, a retraction, a prefix hit)
        self.sources: list[torch.Tensor | None] = []

    def inputs(self, scheduled: ScheduledBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(token ids [T], positions [T], slot table [T, width]) of an all-decode step."""
        reqs = scheduled.reqs
        if len(reqs) != len(self.reqs) or any(a is not b for a, b in zip(reqs, self.reqs)):
            width = max(self.table.shape[1], *(req.slots.shape[0] for req in reqs))
            self.table = torch.zeros(len(reqs), width, dtype=torch.long)
            self.reqs, self.sources = list(reqs), [None] * len(reqs)
        ids = []
        for i, req in enumerate(reqs):
            if req.slots is not self.sources[i]:
                self._refresh(i, req.slots)
            out = req.sampling.output_ids
            ids.append(out[-1] if out else req.prompt_ids[-1])
        positions = torch.tensor(scheduled.starts, dtype=torch.long)
        return torch.tensor(ids, dtype=torch.long), positions, self.table

    def _refresh(self, row: int, slots: torch.Tensor) -> None:
        n = slots.shape[0]
        if n > self.table.shape[1]:
            table = torch.zeros(self.table.shape[0], max(2 * n, 256), dtype=torch.long)
            table[:, : self.table.shape[1]] = self.table
            self.table = table
        self.table[row, :n] = slots
        self.sources[row] = slots
