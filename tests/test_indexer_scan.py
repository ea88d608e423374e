"""The prefill indexer scan (`causal_topk`) against the plain form it replaces: the whole
[rows, heads, context] score tensor, a causal mask and a stable descending sort.

Blocks of rows and tiles of keys of every size give the same scores (to float rounding; exactly
where the inputs make every sum exact) and the same picks, on tie-heavy scores (quantised
queries and keys, one or two heads: many exact ties and exact zeros after the ReLU), for
contiguous positions (a prefill run) and interleaved ones (a context-parallel rank's rows).
"""

from __future__ import annotations

import pytest
import torch
from tie_break import stable_topk

from dsaserve.kernels.indexer_scan import block_scores, causal_topk, decode_scores
from dsaserve.kernels.topk import topk_earliest


def _plain_scores(q, weights, keys, positions) -> torch.Tensor:
    scores = torch.relu(torch.einsum("nhd,ld->nhl", q, keys))
    scores = torch.einsum("nh,nhl->nl", weights, scores)
    later = torch.arange(keys.shape[0])[None, :] > positions[:, None]
    return scores.masked_fill(later, float("-inf"))


def _case(seed: int, rows: int, context: int, heads: int, quantised: bool):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(rows, heads, 16, generator=generator)
    keys = torch.randn(context, 16, generator=generator)
    weights = torch.randn(rows, heads, generator=generator)
    if quantised:  # few distinct values: scores tie exactly, often at the top-k cut
        q, keys, weights = q.round(), keys.round().clamp(-1, 1), weights.sign()
    return q, weights, keys


@pytest.mark.parametrize("heads,quantised", [(1, True), (2, True), (4, False)])
@pytest.mark.parametrize("layout", ["run", "interleaved"])
def test_picks_equal_the_plain_form(heads, quantised, layout):
    k, context = 8, 150
    positions = torch.arange(70, 150) if layout == "run" else torch.arange(1, 150, 2)
    q, weights, keys = _case(heads * 7 + len(positions), len(positions), context, heads, quantised)
    plain = _plain_scores(q, weights, keys, positions)
    want = stable_topk(plain, k).indices.sort(dim=-1).values
    for rows, tile in [(1, 1), (3, 5), (32, 2048), (7, 64), (200, 13)]:
        got = causal_topk(q, weights, keys, positions, k, rows=rows, key_tile=tile)
        assert torch.equal(got, want), f"rows {rows}, key tile {tile}"


def test_early_rows_keep_every_visible_key():
    """Rows that see fewer than k keys keep all of them plus the earliest later positions."""
    q, weights, keys = _case(3, 6, 40, 2, False)
    positions = torch.arange(6)
    got = causal_topk(q, weights, keys, positions, 8, rows=4, key_tile=3)
    assert torch.equal(got, torch.arange(8).expand(6, 8))


def test_block_scores_equal_the_plain_scores():
    """Exactly on quantised inputs (every sum is exact, so ties stay ties whatever the order of
    accumulation), to float rounding otherwise (MKL picks its GEMM kernel by a tile's width)."""
    positions = torch.arange(260, 300)
    for quantised in (True, False):
        q, weights, keys = _case(5, 40, 300, 8, quantised)
        plain = _plain_scores(q, weights, keys, positions)
        for tile in (1, 17, 300):
            got = block_scores(q, weights, keys, positions, 8, key_tile=tile)
            assert torch.equal(torch.isinf(got), torch.isinf(plain))
            if quantised:
                assert torch.equal(got, plain), f"key tile {tile}"
            else:
                torch.testing.assert_close(got, plain, rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("quantised", [True, False])
def test_decode_scores_equal_the_gathered_form(quantised):
    """Decode rows of different lengths (padded), keys at scattered pool slots, scored tile by
    tile: the scores of the gather-everything form (exactly on quantised inputs), same picks."""
    q, weights, pool = _case(11, 5, 400, 2, quantised)
    generator = torch.Generator().manual_seed(4)
    slots = torch.stack([torch.randperm(400, generator=generator)[:90] for _ in range(5)])
    valid = torch.arange(90)[None, :] < torch.tensor([90, 3, 47, 64, 89])[:, None]
    keys = pool[slots]  # [5, 90, 16]
    plain = torch.relu(torch.einsum("bhd,bld->bhl", q, keys))
    plain = torch.einsum("bh,bhl->bl", weights, plain).masked_fill(~valid, float("-inf"))
    for tile in (1, 7, 90, None):
        got = decode_scores(q, weights, pool, slots, valid, tile)
        if quantised:
            assert torch.equal(got, plain), f"tile {tile}"
        else:
            torch.testing.assert_close(got, plain, rtol=1e-6, atol=1e-5)
        assert torch.equal(topk_earliest(got, 8), stable_topk(plain, 8).indices.sort(-1).values)
