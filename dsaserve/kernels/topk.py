"""Top-k with a defined tie-break: among equal scores the earlier position wins.

`torch.topk` leaves the order of equal values unspecified, and in practice it depends on the row's
length and layout. The DSA indexer's scores tie often (a key whose ReLU'd head scores are all zero
scores exactly 0.0), so without a rule a decode row, a prefill chunk's row, a verify row and a
full-sequence reference would keep different keys for the same query over the same prefix. With
this rule the selection is a function of the scores over the row's valid prefix only: positions
past it (masked to -inf) never win over finite ones and padding length does not matter.

Cost stays O(length) per row, with no sort of the row. One `topk` of k + 1 settles most rows:
when the k-th largest score is strictly above the (k+1)-th, the k largest are one set whatever
the tie rule. Only the other rows (a tie at the cut) take the tie-break: every position strictly
above the k-th value is kept, plus the earliest positions equal to it (a cumulative sum over the
equality mask). Off the CPU every row takes the tie-break, which never reads a value back to
the host (the fast path's "is any row tied?" would: CUDA graphs capture no such step). See
docs/determinism.md.
"""

from __future__ import annotations

import torch


def topk_earliest(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Positions [..., k] of the k largest `scores` along the last dim, equal scores broken
    towards the lower position, in increasing position order. Requires k <= scores.shape[-1]."""
    length = scores.shape[-1]
    if not 0 < k <= length:
        raise ValueError(f"k={k} must be in [1, {length}]")
    if k == length:  # every position
        return torch.arange(length, device=scores.device).expand_as(scores).clone()
    if scores.device.type != "cpu":  # no host read (CUDA graphs; the meta-device check)
        return _break_ties(scores, k)
    values, index = scores.topk(k + 1, dim=-1)  # descending
    picks = index[..., :k].sort(dim=-1).values
    tied = ~(values[..., k - 1] > values[..., k])  # a tie at the cut (or NaN)
    if bool(tied.any()):
        picks[tied] = _break_ties(scores[tied], k)
    return picks


def _break_ties(scores: torch.Tensor, k: int) -> torch.Tensor:
    """topk_earliest of rows [R, length] whose k-th and (k+1)-th scores may be equal."""
    length = scores.shape[-1]
    kth = scores.topk(k, dim=-1, sorted=False).values.amin(dim=-1, keepdim=True)
    above = scores > kth
    tied = scores == kth
    need = k - above.sum(dim=-1, keepdim=True)  # how many of the tied positions to keep
    keep = above | (tied & (tied.cumsum(dim=-1) <= need))  # exactly k per row
    rank = keep.cumsum(dim=-1) - 1  # where each kept position lands among the k
    dest = torch.where(keep, rank, k)  # dropped positions go to a spare column
    positions = torch.arange(length, device=scores.device).expand_as(scores)
    out = torch.zeros(*scores.shape[:-1], k + 1, dtype=torch.long, device=scores.device)
    return out.scatter_(-1, dest, positions)[..., :k]
