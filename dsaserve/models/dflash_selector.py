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
    probs: torch.Tensor  # [R, K, k] fp32 q over those candidates (one-hot on greedy rows)


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

    def walk(self, hidden: torch.Tensor, logits: torch.Tensor, anchor: torch.Tensor,
             temperatures: torch.Tensor, uniforms: torch.Tensor) -> Proposal:  # fmt: skip
        """hidden [R, K, H], logits [R, K, V], anchor [R]; temperatures [R] (0: greedy) and
        uniforms [R, K] in [0, 1) for the sampled rows' draws."""
        unary, ids = self.candidates(logits)
        projected = self.hidden_projection(hidden)
        sampled = temperatures > 0
        scale = torch.where(sampled, temperatures, torch.ones_like(temperatures))[:, None]
        predecessor, path, q_rows = anchor, [], []
        for j in range(hidden.shape[1]):
            scores = self.scores(projected[:, j], unary[:, j], ids[:, j], predecessor).float()
            probs = (scores / scale).softmax(dim=-1)
            drawn = _inverse_cdf(probs, uniforms[:, j])
            index = torch.where(sampled, drawn, scores.argmax(dim=-1))
            q_rows.append(torch.where(sampled[:, None], probs, F.one_hot(index, probs.shape[-1])
                                      .to(probs.dtype)))  # fmt: skip
            predecessor = ids[:, j].gather(1, index[:, None])[:, 0]
            path.append(predecessor)
        return Proposal(torch.stack(path, 1), ids, torch.stack(q_rows, 1))


def _inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Per row, the first index whose cumulative probability passes u (clamped to the last)."""
    cdf = probs.double().cumsum(-1)
    chosen = torch.searchsorted(cdf, (uniforms.double() * cdf[:, -1])[:, None], right=True)[:, 0]
    return chosen.clamp_max(probs.shape[-1] - 1)
