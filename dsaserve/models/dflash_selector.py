"""DFlash2's candidate selector: the path a block proposes, one row's top-k at a time.

Row j keeps the top `selector_top_k` tokens of its logits (their logits are the unary scores)
and scores candidate c after the previously chosen token t as

    unary(c) + < predecessor_codebook[t] * hidden_projection(h_j), successor_codebook[c] >,

starting from the block's anchor (the last verified token). Greedy rows take the best score;
sampled rows draw from softmax(scores / temperature) and report that distribution as the draft
probabilities q that rejection sampling divides by (the reference's `CandidateSelector.select`).
The codebooks are stored under their bare names (`candidate_selector.predecessor_codebook`), as
the published checkpoints store them.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn


class Proposal(NamedTuple):
    tokens: torch.Tensor  # [R, K] the proposed path
    ids: torch.Tensor  # [R, K, k] each row's candidate tokens (the support of q)
    probs: torch.Tensor | None  # [R, K, k] fp32 q over those candidates (one-hot on greedy
    # rows); None when no row samples


class CandidateSelector(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        rank, vocab = config.selector_rank, config.vocab_size
        self.top_k = config.selector_top_k
        self.predecessor_codebook = nn.Parameter(torch.zeros(vocab, rank))
        self.successor_codebook = nn.Parameter(torch.zeros(vocab, rank))
        self.hidden_projection = nn.Linear(config.hidden_size, rank, bias=False)

    def candidates(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(unary scores, token ids) [..., k]: each row's top-k, best first."""
        return torch.topk(logits, min(self.top_k, logits.shape[-1]), dim=-1)

    def scores(self, projected, unary, ids, predecessor) -> torch.Tensor:
        """[R, k] scores of candidates `ids` [R, k] after tokens `predecessor` [R], for rows whose
        hidden_projection is `projected` [R, rank]."""
        context = self.predecessor_codebook[predecessor] * projected  # [R, rank]
        return unary + torch.einsum("rd,rkd->rk", context, self.successor_codebook[ids])

    def walk(self, hidden: torch.Tensor, unary: torch.Tensor, ids: torch.Tensor,
             anchor: torch.Tensor, temperatures: torch.Tensor,
             uniforms: torch.Tensor) -> Proposal:  # fmt: skip
        """hidden [R, K, H]; each row's candidates `ids` [R, K, k] and their unary scores (the
        drafter's logits there); anchor [R]; temperatures [R] (0: greedy) and uniforms [R, K]
        in [0, 1) for the sampled rows' draws. Every candidate-after-candidate score is computed
        in one batched product before the walk, which then only picks (the same scores as
        `scores` row by row). `probs` is None when no row samples (no q is needed then)."""
        projected = self.hidden_projection(hidden)  # [R, K, rank]
        succ = self.successor_codebook[ids]  # [R, K, k, rank]
        first = unary[:, 0] + torch.einsum(
            "rd,rkd->rk", self.predecessor_codebook[anchor] * projected[:, 0], succ[:, 0]
        )
        after = self.predecessor_codebook[ids[:, :-1]] * projected[:, 1:, None]  # [R, K-1, k, d]
        moves = unary[:, 1:, None] + torch.einsum("rjpd,rjkd->rjpk", after, succ[:, 1:])
        sampled = temperatures > 0
        any_sampled = bool(sampled.any())
        if not any_sampled:
            return Proposal(_greedy_path(first, moves, ids), ids, None)
        scale = torch.where(sampled, temperatures, torch.ones_like(temperatures))[:, None]
        index, path, q_rows = None, [], []
        for j in range(hidden.shape[1]):
            scores = first if j == 0 else moves[:, j - 1].gather(
                1, index[:, None, None].expand(-1, 1, moves.shape[-1]))[:, 0]  # fmt: skip
            index = scores.argmax(dim=-1)
            if any_sampled:
                probs = (scores.float() / scale).softmax(dim=-1)
                index = torch.where(sampled, _inverse_cdf(probs, uniforms[:, j]), index)
                one_hot = F.one_hot(index, probs.shape[-1]).to(probs.dtype)
                q_rows.append(torch.where(sampled[:, None], probs, one_hot))
            path.append(ids[:, j].gather(1, index[:, None])[:, 0])
        probs = torch.stack(q_rows, 1) if any_sampled else None
        return Proposal(torch.stack(path, 1), ids, probs)


def _greedy_path(first: torch.Tensor, moves: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The greedy walk over precomputed scores: each row's best first candidate, then the best
    candidate after the one chosen (argmaxes taken once, the walk in Python over their lists)."""
    start = first.argmax(dim=-1).tolist()  # [R]
    best = moves.argmax(dim=-1).tolist()  # [R][K - 1][k_prev] -> best next index
    chosen = []
    for r, index in enumerate(start):
        row = [index]
        for step in best[r]:
            row.append(step[row[-1]])
        chosen.append(row)
    index = torch.tensor(chosen, device=ids.device)  # [R, K]
    return ids.gather(2, index[..., None])[..., 0]


def _inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Per row, the first index whose cumulative probability passes u (clamped to the last)."""
    cdf = probs.double().cumsum(-1)
    chosen = torch.searchsorted(cdf, (uniforms.double() * cdf[:, -1])[:, None], right=True)[:, 0]
    return chosen.clamp_max(probs.shape[-1] - 1)
