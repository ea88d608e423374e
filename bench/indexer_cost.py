"""Where a long context's time goes in the indexer, on one thread: the prefill scan and a decode.

    python bench/indexer_cost.py [--context 61440] [--rows 1024] [--heads 8] [--dim 64] [--k 64]

Prefill: `causal_topk` of the last `--rows` rows of a `--context`-token prompt (the last chunk
of a long prefill), against the plain form it replaced (the whole [rows, heads, context] score
tensor, a causal mask, the tie-breaking top-k); GFLOP/s counts the causal scan's multiply-adds.
Decode: one row over `--context` keys, op by op as the decode paths run it: the gather of every
key from the pool, the scores GEMM, the ReLU and weighted head sum, the mask, the top-k; then
the same scores with each 4096-key tile gathered and scored while it is in cache (the layered
decode path's `indexer_scan.decode_scores`), the native decode path's loop that scores each key
where it lies in the pool and its one-pass top-k (`kernels/cpu_decode.cpp`, when it builds),
and this core's streaming read bandwidth (a sum over 512 MB). Best of --repeats.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from dsaserve.engine.decode.native import extension
from dsaserve.kernels.indexer_scan import causal_topk
from dsaserve.kernels.topk import topk_earliest


def best_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1000 * min(times)


def plain_prefill(q, weights, keys, positions, k: int) -> torch.Tensor:
    """The pre-tiling form: [rows, heads, context] scores in blocks of 2^24 elements."""
    picks, context = [], keys.shape[0]
    size = max(1, (1 << 24) // (q.shape[1] * context))
    for start in range(0, q.shape[0], size):
        rows = slice(start, start + size)
        scores = torch.relu(torch.einsum("nhd,ld->nhl", q[rows], keys))
        scores = torch.einsum("nh,nhl->nl", weights[rows], scores)
        later = torch.arange(context)[None, :] > positions[rows][:, None]
        picks.append(topk_earliest(scores.masked_fill(later, float("-inf")), k))
    return torch.cat(picks)


def tiled_decode(q, weights, pool, slots, tile: int = 4096) -> torch.Tensor:
    """Decode scores [B, L] with each key tile gathered and scored while in cache."""
    out = q.new_empty(slots.shape)
    for lo in range(0, slots.shape[1], tile):
        part = slots[:, lo : lo + tile]
        keys = pool.index_select(0, part.reshape(-1)).view(*part.shape, -1)
        scores = torch.bmm(q, keys.transpose(1, 2)).relu_()
        torch.bmm(weights[:, None, :], scores, out=out[:, None, lo : lo + part.shape[1]])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=61440)
    ap.add_argument("--rows", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--k", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    n, h, d, L = args.rows, args.heads, args.dim, args.context
    q, keys = torch.randn(n, h, d, generator=g), torch.randn(L, d, generator=g)
    weights = torch.randn(n, h, generator=g)
    positions = torch.arange(L - n, L)
    flop = 2 * h * d * n * (L - n / 2)
    tiled = best_ms(lambda: causal_topk(q, weights, keys, positions, args.k), args.repeats)
    plain = best_ms(lambda: plain_prefill(q, weights, keys, positions, args.k), args.repeats)
    same = torch.equal(causal_topk(q, weights, keys, positions, args.k),
                       plain_prefill(q, weights, keys, positions, args.k))  # fmt: skip
    print(f"prefill scan, last {n} rows of {L}: tiled {tiled:.0f} ms "
          f"({flop / tiled / 1e6:.1f} GFLOP/s), plain {plain:.0f} ms "
          f"({flop / plain / 1e6:.1f} GFLOP/s), same picks: {same}")  # fmt: skip
    pool = torch.randn(L + 256, d, generator=g)
    slots = torch.arange(L)[None]
    valid = torch.ones(1, L, dtype=torch.bool)
    q1, w1 = q[:1], weights[:1]
    gathered = pool.index_select(0, slots.reshape(-1)).view(1, L, d)
    scores = torch.bmm(q1, gathered.transpose(1, 2))
    summed = torch.bmm(w1[:, None, :], scores.relu())[:, 0]
    ops = {
        "gather keys": lambda: pool.index_select(0, slots.reshape(-1)),
        "scores GEMM": lambda: torch.bmm(q1, gathered.transpose(1, 2)),
        "relu + head sum": lambda: torch.bmm(w1[:, None, :], scores.relu()),
        "mask": lambda: summed.masked_fill(~valid, float("-inf")),
        "top-k": lambda: topk_earliest(summed, args.k),
    }
    costs = {name: best_ms(fn, 10 * args.repeats) for name, fn in ops.items()}
    key_mb = L * d * 4 / 1e6
    print(f"decode, one row over {L} keys ({key_mb:.1f} MB of fp32 keys, "
          f"{2 * h * d * L / 1e6:.0f} MFLOP) per indexer layer:")  # fmt: skip
    for name, ms in costs.items():
        print(f"  {name:<16} {ms:7.3f} ms")
    print(f"  {'total':<16} {sum(costs.values()):7.3f} ms")
    tiled_ms = best_ms(lambda: tiled_decode(q1, w1, pool, slots), 10 * args.repeats)
    steps = ("gather keys", "scores GEMM", "relu + head sum")
    print(f"  gather, GEMM, head sum tile by tile: {tiled_ms:.3f} ms "
          f"(vs {sum(costs[s] for s in steps):.3f})")  # fmt: skip
    native = extension()
    if native is not None:
        args1 = (q1[0].contiguous(), w1[0].contiguous(), pool, slots[0], valid[0])
        native_ms = best_ms(lambda: native.index_scores(*args1), 10 * args.repeats)
        error = (native.index_scores(*args1) - summed[0]).abs().max().item()
        print(f"  native, each key scored in place: {native_ms:.3f} ms "
              f"({key_mb / native_ms:.1f} GB/s of keys; max |diff| {error:.1e})")  # fmt: skip
        topk_ms = best_ms(lambda: native.topk_earliest(summed, args.k), 10 * args.repeats)
        same = torch.equal(native.topk_earliest(summed, args.k), topk_earliest(summed, args.k))
        print(f"  native top-k (one heap pass): {topk_ms:.3f} ms (same picks: {same})")
    big = torch.ones(128 << 20)  # 512 MB
    read = best_ms(lambda: big.sum(), args.repeats)
    print(f"streaming read: {big.numel() * 4 / read / 1e6:.1f} GB/s")


if __name__ == "__main__":
    main()
