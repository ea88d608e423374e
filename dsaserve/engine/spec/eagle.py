"""Speculative decoding with the checkpoint's MTP (nextn) layer: EAGLE / NEXTN, topk 1 (a chain).

One engine step with speculation, K = --speculative-num-steps:

1. **Draft.** A decoding request already holds d_1 and the MTP hidden h'_1 from the previous
   step (4. below). Steps 2..K run the MTP layer autoregressively, batched over requests, one
   token each at positions kv_len .. kv_len+K-2, feeding back its own normed hidden
   (shared_head.norm(h'), as sglang and vLLM do). With `index_share_for_mtp_iteration` these
   steps reuse step 1's indexer selection (plus the draft positions) instead of scoring.
2. **Verify.** One target forward runs the prefill chunks and, per decoding request, K+1 tokens
   [last token, d_1..d_K] at positions kv_len .. kv_len+K, attended as K+1 decode rows (each
   over its own prefix, running its own DSA indexer) in the batched decode pass.
3. **Accept.** Row by row, the target's token is drawn from the target's logits by the engine's
   sampler with the request's own state, exactly as without speculation (penalties, min_tokens,
   seeds); the draft is accepted while it equals that token, and the first differing token is
   the bonus. The draft is greedy, so q is one-hot at d: standard speculative sampling (accept d
   with probability min(1, p(d)/q(d)) = p(d), else draw from norm(max(0, p - q)) = p without d)
   is exactly "draw x ~ p; accept iff x == d; else emit x", so the output distribution is the
   target's (and greedy is token-for-token identical). Tokens go through the engine's `append`
   one at a time, so a stop string, stop token, EOS or max_tokens inside an accepted run ends
   the request at that token and the tokens after it are dropped.
4. **MTP catch-up.** The MTP layer runs over every position the target just computed and kept
   (row i: token i+1 and the target's hidden at i, teacher-forced; decode rows again for the
   verified requests, an extend pass for prefill chunks), which writes exact MTP cache
   entries (MLA and indexer keys) and, from its last row, d_1 and h'_1 for the next round.

KV: both caches hold exact entries for positions [0, kv_len) after every step, so pages handed to
the radix cache (finish, retraction) carry correct MTP entries too. Rejected verify tokens and the
draft steps' MTP entries lie at positions >= kv_len: they are not freed, they are overwritten
before anything reads them (pages are allocated for kv_len + K + 1 tokens per decode).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from dsaserve.engine.decode.runner import ModelRunner
from dsaserve.engine.messages import TokenLogprob
from dsaserve.engine.request import Req
from dsaserve.engine.sampler import Sampler
from dsaserve.engine.scheduler import ScheduledBatch
from dsaserve.engine.spec.report import SpecReport
from dsaserve.engine.spec.verify import Acceptor, Proposals, VerifyLayout
from dsaserve.layers.forward_batch import forward_context
from dsaserve.layers.indexer import Selection, row_mask
from dsaserve.models.dsa_moe import DsaMoeForCausalLM

Append = Callable[[Req, int, "TokenLogprob | None"], None]


@dataclass
class Draft:
    """The first draft of a request's next round: the MTP row at `position` (= kv_len - 1)."""

    position: int
    token: int
    hidden: torch.Tensor  # [H] shared_head.norm(h') at that row
    selection: torch.Tensor | None  # [position + 1] bool: its indexer top-k (None: all)


class EagleDecoder:
    """Runs one engine step with MTP drafting and target verification (see the module doc)."""

    def __init__(
        self, model: DsaMoeForCausalLM, runner: ModelRunner, num_steps: int, share_index: bool
    ) -> None:
        self.model = model
        self.runner = runner
        self.num_steps = num_steps
        self.share_index = share_index and num_steps > 1
        self.report = SpecReport(num_steps)

    # ---- the step -------------------------------------------------------------------------
    def step(self, scheduled: ScheduledBatch, sampler: Sampler, append: Append) -> None:
        entries = zip(scheduled.reqs, scheduled.starts, scheduled.ends)
        verify = [self._can_verify(req) and e - s == 1 for req, s, e in entries]
        layout = VerifyLayout(scheduled, verify, self.num_steps)
        drafts = self._draft([r for r, v in zip(scheduled.reqs, verify) if v])
        first_row, rows = layout.logits_rows(scheduled, self.num_steps)
        logits, hidden = self._verify_forward(scheduled, layout, drafts, rows)
        emitted = self._accept(scheduled, layout, drafts, first_row, logits, sampler, append)
        for i, req in enumerate(scheduled.reqs):
            req.kv_len = scheduled.starts[i] + emitted[i] if verify[i] else scheduled.ends[i]
        self._catch_up(scheduled, layout, hidden)

    def _can_verify(self, req: Req) -> bool:
        draft = req.spec_draft
        return (
            draft is not None
            and draft.position == req.kv_len - 1
            and len(req.fill_ids) == req.kv_len + 1
            and req.slots.shape[0] >= req.kv_len + self.num_steps + 1
        )

    def _draft(self, reqs: list[Req]) -> list[list[int]]:
        """d_1..d_K per verifying request: d_1 is stored, the rest come from the MTP layer."""
        if not reqs:
            return []
        tokens = [[req.spec_draft.token] for req in reqs]
        hidden = torch.stack([req.spec_draft.hidden for req in reqs])
        for k in range(2, self.num_steps + 1):
            starts = [req.kv_len + k - 2 for req in reqs]
            scheduled = ScheduledBatch(reqs, starts, [s + 1 for s in starts],
                                       [[t[-1]] for t in tokens])  # fmt: skip
            batch, _ = self.runner.build(scheduled)
            reuse = self._reuse(reqs, batch.decode_slots.shape[1], k) if self.share_index else None
            with forward_context(batch):
                hidden, _ = self.model.forward_mtp(hidden, reuse)
            for t, token in zip(tokens, self.model.logits(hidden).argmax(dim=-1).tolist()):
                t.append(token)
        return tokens

    def _reuse(self, reqs: list[Req], width: int, k: int) -> Selection:
        """Draft step k attends step 1's top-k over [0, kv_len) plus the k-1 draft positions."""
        if all(req.spec_draft.selection is None for req in reqs):
            return Selection([], None)
        mask = torch.zeros(len(reqs), width, dtype=torch.bool)
        for row, req in enumerate(reqs):
            selection = req.spec_draft.selection
            ctx = req.kv_len + k - 1
            mask[row, :ctx] = True
            if selection is not None:
                mask[row, : selection.shape[0]] = selection.cpu()
        return Selection([], mask.to(self.runner.device))

    def _verify_forward(self, scheduled, layout: VerifyLayout, drafts, rows: list[int]):
        """(the logits of `rows`, the target's final hidden states [T, H] of the prefill chunks
        and verify runs)."""
        pending = iter(drafts)
        input_ids = [[req.fill_ids[-1], *next(pending)] if v else req.fill_ids[s:e]
                     for req, s, e, v in zip(scheduled.reqs, scheduled.starts, scheduled.ends,
                                             layout.verify)]  # fmt: skip
        run = ScheduledBatch(scheduled.reqs, scheduled.starts, layout.ends, input_ids)
        batch, _ = self.runner.build(run, as_decodes=layout.verify)
        picked = torch.tensor(rows, dtype=torch.long, device=self.runner.device)  # may be empty
        return self.runner.run_verify(batch, picked)  # native layers, or a CUDA graph replay

    def _accept(self, scheduled, layout: VerifyLayout, drafts, first_row, logits, sampler,
                append) -> list[int]:  # fmt: skip
        """Emit tokens row by row (see the module doc, 3.; spec/verify.py); return the tokens
        emitted per entry."""
        verifying = [i for i, v in enumerate(layout.verify) if v]
        rows = {i: row for row, i in enumerate(verifying)}  # entry -> its row of `drafts`
        acceptor = Acceptor(sampler, append)
        emitted, counts = acceptor.run(scheduled.reqs, first_row, logits, rows, Proposals(drafts),
                                       self.num_steps)  # fmt: skip
        self.report.add(counts)
        return emitted

    def _catch_up(self, scheduled, layout: VerifyLayout, hidden: torch.Tensor) -> None:
        """MTP over [start, kv_len) of every entry; store the next round's first draft."""
        reqs, starts = scheduled.reqs, scheduled.starts
        ends = [req.kv_len for req in reqs]
        input_ids = [req.fill_ids[s + 1 : e + 1] for req, s, e in zip(reqs, starts, ends)]
        rows = torch.cat([torch.arange(o, o + e - s)
                          for o, s, e in zip(layout.offsets, starts, ends)])  # fmt: skip
        run = ScheduledBatch(reqs, starts, ends, input_ids)
        batch, _ = self.runner.build(run, as_decodes=layout.verify)
        with forward_context(batch):
            mtp_hidden, selection = self.model.forward_mtp(hidden[rows.to(hidden.device)])
        last = (
            torch.tensor(ends, device=hidden.device)
            .sub(torch.tensor(starts, device=hidden.device))
            .cumsum(0)
            - 1
        )
        want = [i for i, req in enumerate(reqs) if not req.finished]
        if not want:
            return
        last_hidden = mtp_hidden[last[want]]
        tokens = self.model.logits(last_hidden).argmax(dim=-1).tolist()
        masks = (
            self._last_row_selections(selection, starts, ends, layout.verify)
            if self.share_index
            else None
        )
        for j, i in enumerate(want):
            mask = masks[i] if masks is not None else None
            reqs[i].spec_draft = Draft(ends[i] - 1, tokens[j], last_hidden[j], mask)

    @staticmethod
    def _last_row_selections(
        selection: Selection, starts, ends, as_decodes: list[bool]
    ) -> list[torch.Tensor | None]:
        """Per entry, the indexer selection of its last MTP row over its context [0, kv_len)."""
        extends, decode_row, out = iter(selection.extends), 0, []
        for s, e, as_decode in zip(starts, ends, as_decodes):
            if e - s > 1 and not as_decode:
                out.append(row_mask(next(extends), e - s - 1, e))
            else:
                decode_row += e - s
                out.append(row_mask(selection.decode, decode_row - 1, e))
        return out
