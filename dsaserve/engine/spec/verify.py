"""Verification, shared by EAGLE/MTP and DFlash: the verify rows' layout and the one accept
loop (which drafts are accepted, row by row, and what is emitted).

Row r of a request's verify run holds the target's logits after its last token and drafts
d_1..d_r. Rows are taken in order, each with the request's sampling state after the tokens
accepted before it (penalties, min_tokens, the grammar), so:

- **greedy drafts (EAGLE's MTP chain, always), and seeded sampling**: q is one-hot, and the
  row's token is the one the engine's sampler draws without speculation; the draft is accepted
  iff it equals that token. This is speculative sampling with a one-hot q (accept d with
  probability p(d) / 1, else draw from norm(max(0, p - q)) = p without d), so the output
  distribution is the target's; greedy output, and a seeded request's tokens, are those of
  decoding without speculation.
- **unseeded sampling with DFlash**: the drafts were drawn from the drafter's q, and the
  reference's `_rejection_sample` decides: accept d with probability min(1, p(d) / q(d))
  (u * q(d) < p(d)), else emit a draw from norm(max(0, p - q)) (p itself where that is empty),
  where p is the distribution the sampler would draw from (grammar mask, penalties,
  temperature, top-k / top-p / min-p). With every draft accepted, the last row's token is
  drawn from p. The output is distributed as the target's (Leviathan et al. 2023), with a
  higher acceptance than a one-hot q.

Tokens go through the engine's `append` one at a time, so a stop inside an accepted run ends
the request there. Logprobs, where asked for, are the target's for the emitted token.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from dsaserve.engine.request import Req
from dsaserve.engine.sampler import Sampler, SamplingState, token_logprobs
from dsaserve.engine.scheduler import ScheduledBatch
from dsaserve.engine.spec.report import SpecCounters

Append = Callable[[Req, int, object], None]


class Proposals(NamedTuple):
    """What a drafter proposes for one step: per verifying request its drafts, and where they
    were drawn from a distribution q (DFlash's unseeded sampling) that q."""

    tokens: list[list[int]]  # per request, its drafts
    probs: torch.Tensor | None = None  # [R, K, V] (DFlash) or [R, K, k] (DFlash2); None: greedy
    ids: torch.Tensor | None = None  # [R, K, k] DFlash2: each row's candidates (q's support)


def is_plain_greedy(state: SamplingState) -> bool:
    """Greedy with nothing that depends on the output so far (the sampler's argmax path).

    A grammar does depend on it: such rows are sampled one verify row at a time, each masked by
    the grammar after the tokens accepted before it, so a draft token the grammar forbids is
    never accepted (the target's masked token differs from it) and greedy constrained output is
    token for token the non-speculative one.
    """
    params = state.params
    return (
        state.grammar is None
        and params.greedy
        and not state.has_penalties
        and params.logprobs is None
        and len(state.output_ids) >= params.min_tokens
    )


def rejection_drawn(state: SamplingState) -> bool:
    """Whether a request's drafts are drawn from q and verified by rejection sampling."""
    return not state.params.greedy and state.params.seed is None


class VerifyLayout:
    """Row bookkeeping for one step: which entries verify (over `num_steps` drafts + the last
    token), and where each entry's rows are (EAGLE and DFlash alike)."""

    def __init__(self, scheduled: ScheduledBatch, verify: list[bool], num_steps: int) -> None:
        self.verify = verify
        self.ends = [s + num_steps + 1 if v else e
                     for s, e, v in zip(scheduled.starts, scheduled.ends, verify)]  # fmt: skip
        self.offsets, row = [], 0
        for s, e in zip(scheduled.starts, self.ends):
            self.offsets.append(row)
            row += e - s

    def logits_rows(self, scheduled: ScheduledBatch, k: int) -> tuple[dict[int, int], list[int]]:
        """({entry: index of its first logits row}, the hidden rows to take logits of): every
        row of a verify run (k + 1), the last row of a chunk that ends its prompt."""
        first_row: dict[int, int] = {}
        rows: list[int] = []
        for i, req in enumerate(scheduled.reqs):
            if self.verify[i]:
                first_row[i] = len(rows)
                rows += range(self.offsets[i], self.offsets[i] + k + 1)
            elif scheduled.ends[i] == len(req.fill_ids):
                first_row[i] = len(rows)
                rows.append(self.offsets[i] + scheduled.ends[i] - scheduled.starts[i] - 1)
        return first_row, rows


class Acceptor:
    """Emits one step's tokens (see the module doc); returns the tokens emitted per entry."""

    def __init__(self, sampler: Sampler, append: Append) -> None:
        self.sampler, self.append = sampler, append

    def run(self, reqs: list[Req], first_row: dict[int, int], logits: torch.Tensor,
            drafts: dict[int, int], proposals: Proposals | None,
            k: int) -> tuple[list[int], SpecCounters]:  # fmt: skip
        """`first_row[i]`: entry i's first logits row (verify entries have k + 1 rows, others
        one); `drafts[i]`: entry i's row in `proposals` (verify entries only)."""
        states = [reqs[i].sampling for i in first_row]
        greedy_ids = logits.argmax(dim=-1).tolist() if all(map(is_plain_greedy, states)) else None
        emitted, counts = [0] * len(reqs), SpecCounters()
        active = list(first_row)
        for r in range(k + 1):
            if not active:
                break
            tokens, accepted = self._row(reqs, active, first_row, r, logits, drafts, proposals, k,
                                         greedy_ids)  # fmt: skip
            still = []
            for i in active:
                token, logprob = tokens[i]
                self.append(reqs[i], token, logprob)
                emitted[i] += 1
                if accepted.get(i):
                    counts.correct_drafts += 1
                    reqs[i].spec_correct_drafts += 1
                    if not reqs[i].finished:
                        still.append(i)
            active = still
        counts.count_verifies([reqs[i] for i in drafts], [emitted[i] for i in drafts], k)
        return emitted, counts

    def _row(self, reqs, active, first_row, r, logits, drafts, proposals, k, greedy_ids):
        """({entry: (token, logprob)}, {entry: draft accepted}) for row r of the active entries."""

        def draft(i: int) -> int | None:
            return proposals.tokens[drafts[i]][r] if i in drafts and r < k else None

        # else greedy drafts (EAGLE's always): q is one-hot, and drawing is the whole test
        drawn_from_q = proposals is not None and proposals.probs is not None
        rejecting = [i for i in active if drawn_from_q and draft(i) is not None
                     and rejection_drawn(reqs[i].sampling)]  # fmt: skip
        drawing = [i for i in active if i not in rejecting]
        out, accepted = {}, {}
        if drawing:
            rows = [first_row[i] + r for i in drawing]
            if greedy_ids is not None:
                picked = [(greedy_ids[row], None) for row in rows]
            else:
                result = self.sampler(logits[rows], [reqs[i].sampling for i in drawing])
                picked = list(zip(result.token_ids, result.logprobs))
            for i, (token, logprob) in zip(drawing, picked):
                out[i] = (token, logprob)
                accepted[i] = token == draft(i)
        if rejecting:
            rows = [first_row[i] + r for i in rejecting]
            states = [reqs[i].sampling for i in rejecting]
            p = self.sampler.distribution(logits[rows], states)  # [n, V]
            tokens, ok = self._reject(p, [drafts[i] for i in rejecting], r, proposals,
                                      [draft(i) for i in rejecting])  # fmt: skip
            logprobs = token_logprobs(logits[rows], tokens, states)
            for j, i in enumerate(rejecting):
                out[i], accepted[i] = (tokens[j], logprobs[j]), ok[j]
        return out, accepted

    def _reject(self, p: torch.Tensor, rows: list[int], r: int, proposals: Proposals,
                draft_tokens: list[int]) -> tuple[list[int], list[bool]]:  # fmt: skip
        """The reference's `_rejection_sample` for one row of several requests."""
        index = torch.tensor(rows, device=p.device)
        d = torch.tensor(draft_tokens, device=p.device)
        q = torch.zeros_like(p)
        if proposals.ids is None:  # DFlash: q over the vocabulary
            q = proposals.probs[index, r].to(p.dtype)
        else:  # DFlash2: q over each row's candidates
            q.scatter_add_(1, proposals.ids[index, r], proposals.probs[index, r].to(p.dtype))
        p_d, q_d = p.gather(1, d[:, None])[:, 0], q.gather(1, d[:, None])[:, 0]
        u = self.sampler.random(2 * len(rows)).to(p.device).view(2, -1)
        ok = (u[0] * q_d < p_d).tolist()
        residual = (p - q).clamp_min(0)
        total = residual.sum(-1, keepdim=True)
        residual = torch.where(total > 0, residual / total.clamp_min(1e-30), p)
        cdf = residual.double().cumsum(-1)
        drawn = torch.searchsorted(cdf, (u[1] * cdf[:, -1])[:, None], right=True)[:, 0]
        drawn = drawn.clamp_max(p.shape[1] - 1).tolist()
        tokens = [t if keep else x for t, keep, x in zip(draft_tokens, ok, drawn)]
        return tokens, ok
