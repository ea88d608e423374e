"""The long-context part of bench/gpu_check.py: the decode indexer and sparse MLA on tensor cores
(issue 44) timed against the forms they replaced and the torch reference, at 4k / 64k / 256k
contexts, one TP8 rank of GLM-5.3 (32 indexer heads x 128, 8 attention heads, top-2048).

- **indexer** (FP8 keys, scores only: the earliest-wins top-k after them did not change): the
  tensor-core form (a bf16 query, what the engine passes) against the IEEE fp32 form (the same
  query in fp32: the FMA dots every query took before) and `reference.indexer_scores`' tiled
  torch form (`indexer_scan.decode_scores`).
- **sparse MLA** over the top-2048 of the context from an fp32 cache (bf16 and FP8 caches ran
  16-bit dots already): bf16 dots (a bf16 query, now) against IEEE fp32 dots (an fp32 query:
  the tile a bf16 query took over an fp32 cache before) and the torch reference.

Each row: milliseconds a call (median of `iters`, after a warm-up), and the floor: the bytes the
op must read (`indexer_cost`, `sparse_mla_bytes`) at the measured copy bandwidth. The old
kernels are not kept beside the new ones: their math is the fp32 query's path of the same
launchers (the indexer's one program a block is now a walk of several; its per-block work is
the old kernel's).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
from gpu_check_kernels import DEVICE, _gen

from dsaserve.kernels import reference
from dsaserve.kernels.indexer_scan import decode_scores
from dsaserve.kernels.kv_quant import quantize_key
from dsaserve.kernels.triton_indexer import indexer_scores
from dsaserve.kernels.triton_sparse_mla import sparse_mla_decode

SLOT_BYTES = 8 + 1 + 4  # our decode metadata a position: int64 slot, bool valid, fp32 score out


def indexer_cost(s, context: int, rows: int = 1) -> dict[str, float]:
    """Bytes and FLOPs of one decode step's indexer on one rank (every layer runs its own, as
    in the built-in GLM-5.3 / DeepSeek-V3.2 specs): the FP8 keys (e4m3 + a 4-byte scale each,
    the HBM floor), our slot table / valid flags / scores beside them, and the multiply-adds
    (q . k for every head, then ReLU, weight and sum)."""
    positions = s.layers * rows * context
    return {
        "key_bytes": positions * (s.index_dim + 4),
        "metadata_bytes": positions * SLOT_BYTES,
        "flops": positions * s.index_heads * (2 * s.index_dim + 3),
    }


def sparse_mla_bytes(s, rows: int, entry_bytes: int) -> int:
    """Bytes one sparse MLA call reads: the top-k entries of each row (plus their int64 slots)."""
    return rows * s.index_topk * (entry_bytes + 8)


def median_ms(fn: Callable[[], object], iters: int) -> float:
    """Median milliseconds of `fn` over `iters` calls after one warm-up (CUDA events on a GPU)."""
    fn()
    times = []
    for _ in range(iters):
        if DEVICE.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            began = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - began))
    return statistics.median(times)


def time_indexer(s, context: int, rows: int, iters: int, bandwidth: float) -> dict:
    """One layer's indexer scores over `context` FP8 keys for `rows` decode rows."""
    g = _gen(context + rows)
    cache = quantize_key(torch.randn(rows * context, s.index_dim, device=DEVICE, generator=g))
    table = torch.randperm(rows * context, device=DEVICE, generator=g).view(rows, context)
    valid = torch.ones(rows, context, dtype=torch.bool, device=DEVICE)
    q = torch.randn(rows, s.index_heads, s.index_dim, device=DEVICE, generator=g).bfloat16()
    w = torch.randn(rows, s.index_heads, device=DEVICE, generator=g) * s.index_heads**-0.5
    one_layer = {k: v / s.layers for k, v in indexer_cost(s, context, rows).items()}
    return {
        "op": "indexer scores, fp8 keys", "context": context, "rows": rows,
        "new_ms": median_ms(lambda: indexer_scores(q, w, cache, table, valid), iters),
        "old_ms": median_ms(lambda: indexer_scores(q.float(), w, cache, table, valid), iters),
        "torch_ms": median_ms(lambda: decode_scores(q, w, cache, table, valid), iters),
        "floor_ms": one_layer["key_bytes"] / bandwidth * 1e3, "gflop": one_layer["flops"] / 1e9,
    }  # fmt: skip


def time_sparse_mla(s, context: int, rows: int, iters: int, bandwidth: float) -> dict:
    """One layer's sparse MLA over each row's top-k of `context` entries of an fp32 cache."""
    g = _gen(context + rows + 1)
    width = s.rank + s.rope
    cache = torch.randn(rows * context, width, device=DEVICE, generator=g).bfloat16().float()
    table = torch.randperm(rows * context, device=DEVICE, generator=g).view(rows, context)
    picks = torch.rand(rows, context, device=DEVICE, generator=g).topk(s.index_topk).indices
    slots = table.gather(1, picks)
    allowed = torch.ones_like(slots, dtype=torch.bool)
    q = torch.randn(rows, s.heads, width, device=DEVICE, generator=g).bfloat16()
    scale = (s.nope + s.rope) ** -0.5
    args = (cache, slots, allowed, s.rank, scale)
    return {
        "op": "sparse MLA, fp32 cache", "context": context, "rows": rows,
        "new_ms": median_ms(lambda: sparse_mla_decode(q, *args), iters),
        "old_ms": median_ms(lambda: sparse_mla_decode(q.float(), *args), iters),
        "torch_ms": median_ms(lambda: reference.sparse_mla_decode(q, *args), iters),
        "floor_ms": sparse_mla_bytes(s, rows, 4 * width) / bandwidth * 1e3, "gflop": 0.0,
    }  # fmt: skip


def run_attention_timing(s, contexts, rows: int, iters: int, bandwidth: float) -> list[dict]:
    return [timer(s, context, rows, iters, bandwidth)
            for context in contexts for timer in (time_indexer, time_sparse_mla)]  # fmt: skip


def table(results: list[dict]) -> str:
    head = ("| op | context | rows | new ms | old ms | torch ms | floor ms |\n"
            "|---|---:|---:|---:|---:|---:|---:|")  # fmt: skip
    lines = [f"| {r['op']} | {r['context']} | {r['rows']} | {r['new_ms']:.3f} | "
             f"{r['old_ms']:.3f} | {r['torch_ms']:.3f} | {r['floor_ms']:.3f} |"
             for r in results]  # fmt: skip
    return "\n".join([head, *lines])
