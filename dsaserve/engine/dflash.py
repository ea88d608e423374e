"""Speculative decoding with a DFlash / DFlash2 block drafter: `--speculative-algorithm DFLASH`.

One engine step, block size B (K = B - 1 drafts):

1. **Draft.** Every decoding request proposes K tokens in one drafter forward over its block
   [last token, mask x K] (`dflash_draft.py`): the drafter attends the request's cached context
   entries, so nothing is recomputed or copied per step.
2. **Verify.** One target forward runs the prefill chunks and, per decoding request, B tokens
   [last token, d_1..d_K] at positions kv_len .. kv_len + K as B decode rows (each over its own
   prefix, running its own DSA indexer), returning with the final hidden states the hidden
   states of the drafter's target layers (`DsaMoeForCausalLM.forward(taps)`; the CUDA graphs
   capture the same).
3. **Accept.** Row by row, as `dflash_accept.py` says: greedy output equals decoding without
   speculation, and sampled output is distributed as the target's.
4. **Context.** The tapped states of every position the target just computed and kept (the
   accepted verify rows, every prefill row) become the drafter's context entries at those
   positions' slots, so the next step drafts from exactly [0, kv_len).

KV: the target's verify writes B entries; rejected ones lie at positions >= kv_len and are
overwritten before anything reads them (pages are allocated for kv_len + B tokens per decode).
"""

from __future__ import annotations

import torch

from dsaserve.engine.dflash_accept import Acceptor, Append, rejection_drawn
from dsaserve.engine.dflash_draft import DraftContext, Drafter, Proposals
from dsaserve.engine.model_runner import ModelRunner
from dsaserve.engine.request import Req
from dsaserve.engine.scheduler import ScheduledBatch
from dsaserve.engine.spec_report import SpecReport
from dsaserve.engine.speculative import VerifyLayout
from dsaserve.layers.sampler import Sampler


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
        hidden = self._verify_forward(scheduled, layout, drafting, proposals)
        emitted = self._accept(scheduled, layout, drafting, proposals, hidden, sampler, append)
        for i, req in enumerate(reqs):
            req.kv_len = scheduled.starts[i] + emitted[i] if verify[i] else scheduled.ends[i]
        self._write_context(scheduled, layout, hidden)

    def _can_verify(self, req: Req) -> bool:
        """Decoding, with pages for the whole block (the scheduler grows them by B)."""
        fits = req.slots.shape[0] >= req.kv_len + self.block_size
        return len(req.fill_ids) == req.kv_len + 1 and req.kv_len > 0 and fits

    def _draft(self, reqs: list[Req], sampler: Sampler) -> Proposals | None:
        if not reqs:
            return None
        sampled = [rejection_drawn(req.sampling) for req in reqs]
        return self.drafter.propose(reqs, sampled, sampler)

    def _verify_forward(self, scheduled, layout: VerifyLayout, drafting, proposals) -> torch.Tensor:
        """[T, H * (1 + taps)]: final and tapped hidden states of the chunks and verify runs."""
        block = {i: proposals.tokens[j] for j, i in enumerate(drafting)}
        input_ids = [[req.fill_ids[s], *block[i]] if i in block else req.fill_ids[s:e]
                     for i, (req, s, e) in enumerate(zip(scheduled.reqs, scheduled.starts,
                                                         scheduled.ends))]  # fmt: skip
        run = ScheduledBatch(scheduled.reqs, scheduled.starts, layout.ends, input_ids)
        batch, _ = self.runner.build(run, as_decodes=layout.verify)
        return self.runner.run_target(batch, self.taps)

    def _accept(self, scheduled, layout, drafting, proposals, hidden, sampler, append) -> list[int]:
        reqs, k = scheduled.reqs, self.num_steps
        first_row, rows = layout.logits_rows(scheduled, k)
        width = self.model.config.hidden_size
        picked = torch.tensor(rows, dtype=torch.long, device=hidden.device)  # may be empty
        logits = self.model.logits(hidden[picked, :width])
        drafts = {i: j for j, i in enumerate(drafting)}
        emitted, counts = Acceptor(sampler, append).run(reqs, first_row, logits, drafts,
                                                        proposals, k)  # fmt: skip
        self.report.add(counts)
        return emitted

    def _write_context(self, scheduled, layout: VerifyLayout, hidden: torch.Tensor) -> None:
        """Drafter context entries of every position computed and kept this step."""
        rows, positions, slots = [], [], []
        for i, req in enumerate(scheduled.reqs):
            start, kept = scheduled.starts[i], req.kv_len - scheduled.starts[i]
            rows.append(torch.arange(layout.offsets[i], layout.offsets[i] + kept))
            positions.append(torch.arange(start, start + kept))
            slots.append(req.slots[start : start + kept])
        device = hidden.device
        taps = hidden[torch.cat(rows).to(device), self.model.config.hidden_size :]
        self.context.write(taps, torch.cat(positions).to(device), torch.cat(slots).to(device))
