"""Speculative decoding with a DFlash / DFlash2 block drafter: `--speculative-algorithm DFLASH`.

One engine step, block size B (K = B - 1 drafts):

1. **Draft.** Every decoding request proposes K tokens in one drafter forward over its block
   [last token, mask x K] (`draft.py`): the drafter attends the request's cached context
   entries, so nothing is recomputed or copied per step.
2. **Verify.** One target forward runs the prefill chunks and, per decoding request, B tokens
   [last token, d_1..d_K] at positions kv_len .. kv_len + K as B decode rows (each over its own
   prefix, running its own DSA indexer), returning with the logits the hidden states of the
   drafter's target layers (`ModelRunner.run_verify`: the native decode layers copy them out
   in the same C++ call; the layered model's `forward(taps)` and the CUDA graphs add them).
3. **Accept.** Row by row, as `verify.py` says: greedy output equals decoding without
   speculation, and sampled output is distributed as the target's.
4. **Context.** The tapped states of every position the target just computed and kept (the
   accepted verify rows, every prefill row) become the drafter's context entries at those
   positions' slots, so the next step drafts from exactly [0, kv_len).

KV: the target's verify writes B entries; rejected ones lie at positions >= kv_len and are
overwritten before anything reads them (pages are allocated for kv_len + B tokens per decode).
"""

from __future__ import annotations

import torch

from dsaserve.engine.decode.runner import ModelRunner
from dsaserve.engine.request import Req
from dsaserve.engine.sampler import Sampler
from dsaserve.engine.scheduler import ScheduledBatch
from dsaserve.engine.spec.draft import DraftContext, Drafter
from dsaserve.engine.spec.report import SpecReport
from dsaserve.engine.spec.verify import Acceptor, Append, Proposals, VerifyLayout, rejection_drawn


class DFlashDecoder:
    """Runs one engine step with block drafting and target verification (see the module doc)."""

    def __init__(self, runner: ModelRunner, drafter: Drafter, taps: tuple[int, ...]) -> None:
        self.runner = runner
        self.model = runner.model
        self.drafter = drafter
        self.context: DraftContext = drafter.context
        self.taps = taps
        self.block_size = drafter.block_size
        self.num_steps = self.block_size - 1
        self.report = SpecReport(self.num_steps, {"spec_algorithm": "DFLASH",
                                                  "spec_block_size": self.block_size})  # fmt: skip

    # ---- the step -------------------------------------------------------------------------
    def step(self, scheduled: ScheduledBatch, sampler: Sampler, append: Append) -> None:
        reqs = scheduled.reqs
        verify = [self._can_verify(req) and e - s == 1
                  for req, s, e in zip(reqs, scheduled.starts, scheduled.ends)]  # fmt: skip
        layout = VerifyLayout(scheduled, verify, self.num_steps)
        drafting = [i for i, v in enumerate(verify) if v]
        proposals = self._draft([reqs[i] for i in drafting], sampler)
        first_row, rows = layout.logits_rows(scheduled, self.num_steps)
        logits, tapped = self._verify_forward(scheduled, layout, drafting, proposals, rows)
        emitted = self._accept(scheduled, drafting, proposals, first_row, logits, sampler, append)
        for i, req in enumerate(reqs):
            req.kv_len = scheduled.starts[i] + emitted[i] if verify[i] else scheduled.ends[i]
        self._write_context(scheduled, layout, tapped)

    def _can_verify(self, req: Req) -> bool:
        """Decoding, with pages for the whole block (the scheduler grows them by B)."""
        fits = req.slots.shape[0] >= req.kv_len + self.block_size
        return len(req.fill_ids) == req.kv_len + 1 and req.kv_len > 0 and fits

    def _draft(self, reqs: list[Req], sampler: Sampler) -> Proposals | None:
        if not reqs:
            return None
        sampled = [rejection_drawn(req.sampling) for req in reqs]
        return self.drafter.propose(reqs, sampled, sampler)

    def _verify_forward(self, scheduled, layout: VerifyLayout, drafting, proposals, rows):
        """(the logits [R, V] of `rows`: every verify row, the last row of each chunk that ends
        its prompt; the tapped states [T, n * H] of every row computed)."""
        block = {i: proposals.tokens[j] for j, i in enumerate(drafting)}
        input_ids = [[req.fill_ids[s], *block[i]] if i in block else req.fill_ids[s:e]
                     for i, (req, s, e) in enumerate(zip(scheduled.reqs, scheduled.starts,
                                                         scheduled.ends))]  # fmt: skip
        run = ScheduledBatch(scheduled.reqs, scheduled.starts, layout.ends, input_ids)
        batch, _ = self.runner.build(run, as_decodes=layout.verify)
        picked = torch.tensor(rows, dtype=torch.long, device=self.runner.device)  # may be empty
        return self.runner.run_verify(batch, picked, self.taps)

    def _accept(self, scheduled, drafting, proposals, first_row, logits, sampler,
                append) -> list[int]:  # fmt: skip
        reqs, k = scheduled.reqs, self.num_steps
        drafts = {i: j for j, i in enumerate(drafting)}
        emitted, counts = Acceptor(sampler, append).run(reqs, first_row, logits, drafts,
                                                        proposals, k)  # fmt: skip
        self.report.add(counts)
        return emitted

    def _write_context(self, scheduled, layout: VerifyLayout, tapped: torch.Tensor) -> None:
        """Drafter context entries of every position computed and kept this step."""
        rows, positions, slots = [], [], []
        for i, req in enumerate(scheduled.reqs):
            start, kept = scheduled.starts[i], req.kv_len - scheduled.starts[i]
            rows += range(layout.offsets[i], layout.offsets[i] + kept)
            positions += range(start, start + kept)
            slots.append(req.slots[start : start + kept])
        device = tapped.device
        taps = tapped[torch.tensor(rows, device=device)]
        slots = slots[0] if len(slots) == 1 else torch.cat(slots)
        self.context.write(taps, torch.tensor(positions, device=device), slots.to(device))
