"""The indexer's causal scan for prefill rows: every row's score over every earlier key, top-k.

I(t, s) = sum_h w_h(t) * ReLU(q_h(t) . k(s)) for s <= pos(t). A prompt of n tokens costs
n^2 / 2 * heads * dim * 2 FLOP here (the one quadratic part of a DSA prefill), so the scan is
laid out for the matmul units rather than for memory:

- rows go in blocks of ROWS; a block scores only the keys up to its last row's position (the
  causal triangle is skipped, not masked), and masks just the few keys past its first row;
- the keys go in tiles of KEY_TILE, so the [rows * heads, tile] GEMM output, its ReLU (in place)
  and the per-row weighted sum over heads stay in cache instead of streaming a
  [rows, heads, context] tensor through memory three times.

Decode rows (`decode_scores`) score their padded contexts tile by tile too: each tile's keys are
gathered from the paged pool and scored while they are in cache, instead of gathering every key
of the context first (at 60k keys that gather alone is a 15.7 MB copy per layer).

Each score is the same dot product and the same weighted sum over heads (a bmm) as the plain
form `relu(einsum("nhd,ld->nhl")) -> einsum("nh,nhl->nl")`, up to the order MKL's kernel for a
tile's width accumulates in (as the decode path's bmm already differs); exact ties stay exact,
and `topk_earliest` gives them to the earlier position, so the picks do not depend on the block
sizes (tests/test_indexer_scan.py).
"""

from __future__ import annotations

import torch

from dsaserve.kernels.kv_quant import KV_STORE
from dsaserve.kernels.topk import topk_earliest

ROWS = 32  # query rows per block: a [ROWS * heads, KEY_TILE] fp32 tile is 2 MiB (the L2 size)
KEY_TILE = 2048
DECODE_KEYS = 4096  # keys gathered per decode tile, over all rows (1 MiB of 64-dim fp32 keys)


def causal_topk(
    q: torch.Tensor,
    weights: torch.Tensor,
    keys: torch.Tensor,
    positions: torch.Tensor,
    k: int,
    rows: int | None = None,
    key_tile: int | None = None,
) -> torch.Tensor:
    """Top-k key positions [n, k] (increasing, earlier wins ties) of n rows over `keys`.

    q [n, heads, dim], weights [n, heads] (scales folded in), keys [L, dim] (fp32), positions
    [n] each row's own position in the context (non-decreasing; row t sees keys 0..pos(t)).
    Rows that see fewer than k keys also pick the earliest positions past their own, which the
    attention masks (as for every selection). Blocks: `rows` x `key_tile` (ROWS, KEY_TILE)."""
    rows, key_tile = rows or ROWS, key_tile or KEY_TILE
    picks = [torch.zeros(0, k, dtype=torch.long, device=q.device)]
    q, weights = q.float(), weights.float()
    host = positions.tolist()  # block widths from the host: no device sync per block
    for start in range(0, q.shape[0], rows):
        block = slice(start, min(start + rows, q.shape[0]))
        span = (host[block.start], host[block.stop - 1])
        scores = block_scores(q[block], weights[block], keys, positions[block], k, key_tile, span)
        picks.append(topk_earliest(scores, k))
    return torch.cat(picks)


def block_scores(
    q,
    weights,
    keys,
    positions,
    k: int,
    key_tile: int = KEY_TILE,
    span: tuple[int, int] | None = None,
) -> torch.Tensor:
    """Scores [b, width] of one block of rows over keys [0, width): width is one past the last
    row's position (at least k), keys past a row's own position are -inf. `span`: the first and
    last row's positions, if known on the host."""
    count, heads, dim = q.shape
    first, last = span if span is not None else (int(positions[0]), int(positions[-1]))
    width = max(last + 1, k)
    scores = q.new_empty(count, width)
    flat = q.reshape(count * heads, dim)
    keys_t = keys.t()  # [dim, L] (a view: the GEMM reads it transposed)
    for lo in range(0, width, key_tile):
        hi = min(lo + key_tile, width)
        part = torch.mm(flat, keys_t[:, lo:hi]).relu_().view(count, heads, hi - lo)
        torch.bmm(weights[:, None, :], part, out=scores[:, None, lo:hi])  # [b, 1, tile]
    low = first + 1  # keys before `low` are visible to every row of the block
    if low < width:
        later = torch.arange(low, width, device=q.device)[None, :] > positions[:, None]
        scores[:, low:].masked_fill_(later, float("-inf"))
    return scores


def decode_scores(q, weights, cache, slots, valid, tile: int | None = None) -> torch.Tensor:
    """Indexer scores [B, L] of decode rows q [B, heads, dim] (fp32), weights [B, heads], over
    the pool keys `cache` at `slots` [B, L], -inf where not `valid`."""
    rows, length = slots.shape
    tile = tile or max(256, DECODE_KEYS // max(rows, 1))
    scores = q.new_empty(rows, length, dtype=torch.float32)
    q, weights = q.float(), weights.float()[:, None, :]
    for lo in range(0, length, tile):
        part = slots[:, lo : lo + tile]
        keys = KV_STORE.read_key(cache, part, torch.float32)  # [B, t, dim]
        heads = torch.bmm(q, keys.transpose(1, 2)).relu_()  # [B, heads, t]
        torch.bmm(weights, heads, out=scores[:, None, lo : lo + part.shape[1]])
    return scores.masked_fill_(~valid, float("-inf"))
