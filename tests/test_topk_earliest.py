"""`topk_earliest` against the plain definition (a stable descending sort), on tie-heavy rows."""

from __future__ import annotations

import pytest
import torch
from tie_break import stable_topk

from dsaserve.kernels.topk import topk_earliest


def _expected(scores: torch.Tensor, k: int) -> torch.Tensor:
    return stable_topk(scores, k).indices.sort(dim=-1).values


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("length,k", [(1, 1), (9, 8), (64, 8), (300, 40), (50, 50)])
def test_matches_stable_sort_on_ties(dtype, length, k):
    generator = torch.Generator().manual_seed(length * 131 + k)
    for distinct in (1, 2, 5, 1000):  # few distinct values: ties everywhere
        scores = torch.randint(0, distinct, (6, length), generator=generator).to(dtype)
        scores[scores == 0] = 0.0 if distinct % 2 else -0.0  # -0.0 equals 0.0
        invalid = torch.rand(6, length, generator=generator) < 0.3
        scores = scores.masked_fill(invalid, float("-inf"))
        got = topk_earliest(scores, k)
        assert got.shape == (6, k) and got.dtype == torch.long
        assert torch.equal(got, _expected(scores, k)), f"{distinct} distinct values"


def test_rows_with_and_without_a_tie_at_the_cut_in_one_call():
    """Rows settled by one top-k (k-th score above the (k+1)-th) and rows that need the
    tie-break, mixed in one [2, 5, L] tensor, each as the stable sort picks it."""
    generator = torch.Generator().manual_seed(7)
    scores = torch.randn(2, 5, 90, generator=generator)
    scores[0, 1] = scores[0, 1].round()  # many equal values around the cut
    scores[1, 3, 40:] = 0.0  # a run of zeros
    scores[1, 3, :40] = -1.0
    scores[1, 4, 50:] = float("-inf")
    got = topk_earliest(scores, 12)
    assert torch.equal(got, _expected(scores, 12))
    assert got[1, 3].tolist() == list(range(40, 52))


def test_rule_is_independent_of_padding_and_batch():
    """A row's picks over its valid prefix do not depend on how far it is padded with -inf (a
    decode batch pads to the longest context) nor on the other rows."""
    row = torch.tensor([0.0, 3.0, 0.0, 0.0, 1.0, 0.0, 3.0, 0.0, 0.0, 0.0])
    alone = topk_earliest(row[None], 4)[0].tolist()
    assert alone == [0, 1, 4, 6]
    padded = torch.cat([row, torch.full((37,), float("-inf"))])
    other = torch.randn(47)
    assert topk_earliest(torch.stack([other, padded]), 4)[1].tolist() == alone


def test_short_rows_keep_every_valid_position():
    """Fewer finite scores than k (early causal rows): every finite position is kept, and the
    rest are the earliest -inf positions, which callers mask as before."""
    scores = torch.tensor([[-2.0, 5.0, float("-inf"), -1.0, float("-inf"), float("-inf")]])
    assert topk_earliest(scores, 4)[0].tolist() == [0, 1, 2, 3]


def test_rejects_k_out_of_range():
    with pytest.raises(ValueError, match="k=5"):
        topk_earliest(torch.zeros(2, 4), 5)
