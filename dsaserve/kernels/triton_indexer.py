"""Triton: the DSA indexer's decode scores, read straight from the pool, then top-k.

A program walks `steps` blocks of BLOCK_L candidate entries of one decode row and scores each
block for every indexer head: S[h, l] = q[h] . k[l], then I[l] = sum_h w[h] * ReLU(S[h, l]).
Keys are read through the row's slot table (the pool's pages, any page size) from a float
cache or the FP8 layout (e4m3 bytes + a per-token fp32 scale, kernels/kv_quant.py).

- **16-bit query** (the engine's bf16 / fp16 compute): one tensor-core dot a block, computed
  transposed (swap-AB, as DeepGEMM's MQA logits): the block's keys are the M (BLOCK_L = 64:
  wgmma on sm_90, tcgen05 on sm_100, mma.sync before), the heads the N (padded to 16 by
  masking), the index dim the K. FP8 keys enter the dot as their e4m3 values widened to the
  query's dtype (exact), and each key's scale multiplies its row of the accumulator; a float
  cache's keys are rounded to the query's dtype, which is exact for the keys this engine writes
  (it computes them in that dtype). Every product is then exact and the sums are fp32: the
  scores are the reference's up to the order of the additions (`score_bound`). ReLU and the
  per-head weights act on the accumulator; the weighted sum runs across its columns.
- **fp32 query** (fp32 engines, the CPU tests): IEEE fp32 `tl.dot`s over CHUNK_D of the key at
  a time, chained through the accumulator (FMAs whose operands sit in registers: no thread
  holds a whole 128-wide row, so 64 heads compile without spills).

The top-k is `topk_earliest` over these scores, so equal scores keep the earlier position,
exactly as the reference does (docs/determinism.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsaserve.kernels.gpu_target import fp8_in_hardware, has_wgmma
from dsaserve.kernels.kv_quant import is_fp8
from dsaserve.kernels.topk import topk_earliest
from dsaserve.kernels.triton_support import load_e4m3

BLOCK_L = 64  # entries a block: the M of the tensor-core dot (wgmma / tcgen05 need 64)
CHUNK_D = 32  # the fp32 dot's K a step: IEEE fp32 dots are FMAs whose operands sit in registers
TARGET_PROGRAMS = 256  # programs a launch; past that each program walks more blocks
DOT_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
UNIT_ROUNDOFF = 2.0**-24  # fp32's


@triton.jit
def _keys(cache_ptr, slot, in_l, ds, cache_stride, D: tl.constexpr, FP8: tl.constexpr,
          SOFT_FP8: tl.constexpr):  # fmt: skip
    """Keys [BLOCK_L, len(ds)] at `slot` as fp32, 0 where not in_l: FP8 ones unscaled."""
    kptr = cache_ptr + slot[:, None] * cache_stride + ds[None, :]
    kmask = in_l[:, None] & (ds[None, :] < D)
    if FP8:
        k = load_e4m3(kptr, kmask, SOFT_FP8)
    else:
        k = tl.load(kptr, mask=kmask, other=0.0).to(tl.float32)
    return k


@triton.jit
def _scores_mma(q_t, cache_ptr, scale_ptr, slot, in_l, w, cache_stride, scale_stride,
                D: tl.constexpr, FP8: tl.constexpr, SOFT_FP8: tl.constexpr, DOT: tl.constexpr,
                BLOCK_D: tl.constexpr):  # fmt: skip
    """I [BLOCK_L] of one block: S^T = k . q^T on tensor cores (keys the M, heads the N)."""
    k = _keys(cache_ptr, slot, in_l, tl.arange(0, BLOCK_D), cache_stride, D, FP8, SOFT_FP8)
    s = tl.dot(k.to(DOT), q_t)  # [BLOCK_L, BLOCK_H], fp32 accumulation
    if FP8:  # each key's scale on its row of the accumulator
        s = s * tl.load(scale_ptr + slot * scale_stride, mask=in_l, other=0.0)[:, None]
    return tl.sum(tl.maximum(s, 0.0) * w[None, :], axis=1)


@triton.jit
def _scores_fp32(q_ptr, cache_ptr, scale_ptr, slot, in_l, w, hs, H, cache_stride, scale_stride,
                 D: tl.constexpr, FP8: tl.constexpr, SOFT_FP8: tl.constexpr,
                 BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_L: tl.constexpr,
                 CHUNK_D: tl.constexpr):  # fmt: skip
    """I [BLOCK_L] of one block: S as IEEE fp32 dots, CHUNK_D of K a step (one dot's order)."""
    if FP8:
        key_scale = tl.load(scale_ptr + slot * scale_stride, mask=in_l, other=0.0)
    s = tl.zeros((BLOCK_H, BLOCK_L), dtype=tl.float32)
    for d0 in tl.static_range(0, BLOCK_D, CHUNK_D):
        ds = d0 + tl.arange(0, CHUNK_D)
        qmask = (hs[:, None] < H) & (ds[None, :] < D)
        q = tl.load(q_ptr + hs[:, None] * D + ds[None, :], mask=qmask, other=0.0).to(tl.float32)
        k = _keys(cache_ptr, slot, in_l, ds, cache_stride, D, FP8, SOFT_FP8)
        if FP8:
            k = k * key_scale[:, None]
        s = tl.dot(q, tl.trans(k), s, input_precision="ieee")  # [BLOCK_H, BLOCK_L]
    return tl.sum(tl.maximum(s, 0.0) * w[:, None], axis=0)


@triton.jit(do_not_specialize=["L", "STEPS"])
def _indexer_scores_kernel(
    q_ptr, w_ptr, cache_ptr, scale_ptr, slots_ptr, valid_ptr, out_ptr,
    H, L, STEPS, cache_stride, scale_stride,
    D: tl.constexpr, FP8: tl.constexpr, SOFT_FP8: tl.constexpr, DOT: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_L: tl.constexpr, CHUNK_D: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    hs = tl.arange(0, BLOCK_H)
    q_row = q_ptr + b * H * D
    w = tl.load(w_ptr + b * H + hs, mask=hs < H, other=0.0)
    if DOT != tl.float32:  # q^T [BLOCK_D, BLOCK_H], loaded once for every block
        ds = tl.arange(0, BLOCK_D)
        q_t = tl.load(q_row + hs[None, :] * D + ds[:, None],
                      mask=(hs[None, :] < H) & (ds[:, None] < D), other=0.0).to(DOT)  # fmt: skip
    first = tl.program_id(1) * STEPS
    for block in range(first, tl.minimum(first + STEPS, tl.cdiv(L, BLOCK_L))):
        ls = block * BLOCK_L + tl.arange(0, BLOCK_L)
        in_l = ls < L
        slot = tl.load(slots_ptr + b * L + ls, mask=in_l, other=0).to(tl.int64)
        if DOT != tl.float32:
            score = _scores_mma(q_t, cache_ptr, scale_ptr, slot, in_l, w, cache_stride,
                                scale_stride, D, FP8, SOFT_FP8, DOT, BLOCK_D)  # fmt: skip
        else:
            score = _scores_fp32(q_row, cache_ptr, scale_ptr, slot, in_l, w, hs, H, cache_stride,
                                 scale_stride, D, FP8, SOFT_FP8, BLOCK_H, BLOCK_D, BLOCK_L,
                                 CHUNK_D)  # fmt: skip
        valid = tl.load(valid_ptr + b * L + ls, mask=in_l, other=0) != 0
        tl.store(out_ptr + b * L + ls, tl.where(valid, score, float("-inf")), mask=in_l)


def dot_dtype(q_dtype: torch.dtype) -> tl.dtype:
    """The dots' operand dtype: a 16-bit query's (tensor cores), else IEEE fp32."""
    return DOT_DTYPES.get(q_dtype, tl.float32)


def steps(rows: int, length: int) -> int:
    """Blocks a program walks: about TARGET_PROGRAMS programs, one block at least."""
    blocks = max(triton.cdiv(length, BLOCK_L), 1)
    return triton.cdiv(blocks, max(TARGET_PROGRAMS // max(rows, 1), 1))


def indexer_scores(q, weights, cache, slots, valid) -> torch.Tensor:
    """Scores [B, L] fp32 of decode rows q [B, H, D] (weights [B, H] with the scales folded
    in) over the index keys at `slots` [B, L]; -inf where not `valid`. A bf16 / fp16 q runs
    on tensor cores (its dtype is the dots'), an fp32 one as IEEE fp32."""
    b, h, d = q.shape
    length = slots.shape[1]
    out = torch.empty(b, length, dtype=torch.float32, device=q.device)
    if b == 0 or length == 0:
        return out
    fp8 = is_fp8(cache)
    scales = cache.view(torch.float32) if fp8 else cache  # per-token scale: the last 4 bytes
    scale_ptr = scales[:, -1] if fp8 else cache
    block_h = max(16, triton.next_power_of_2(h))
    dot = dot_dtype(q.dtype)
    # 64 heads: 8 warps for FMAs, and for mma.sync (sm_120's 4 spilled 16 B over fp32 keys)
    wide = block_h >= 64 and (dot == tl.float32 or not has_wgmma(q.device))
    walk = steps(b, length)
    grid = (b, triton.cdiv(triton.cdiv(length, BLOCK_L), walk))
    _indexer_scores_kernel[grid](
        q.contiguous(), weights.float().contiguous(), cache, scale_ptr, slots.contiguous(),
        valid.to(torch.int8).contiguous(), out, h, length, walk, cache.stride(0),
        scales.stride(0) if fp8 else 0,
        D=d, FP8=fp8, SOFT_FP8=fp8 and not fp8_in_hardware(q.device), DOT=dot, BLOCK_H=block_h,
        BLOCK_D=max(CHUNK_D, triton.next_power_of_2(d)), BLOCK_L=BLOCK_L, CHUNK_D=CHUNK_D,
        num_warps=8 if wide else 4,
    )  # fmt: skip
    return out


def indexer_decode_topk(q, weights, cache, slots, valid, k: int) -> torch.Tensor:
    """Top-k positions [B, k] into slots' columns; equal scores keep the earlier position."""
    return topk_earliest(indexer_scores(q, weights, cache, slots, valid), k)


def score_bound(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """How far [B, L] a score of `indexer_scores` may lie from the reference's over the same
    keys [B, L, D] (fp32, as the reference reads them), for a 16-bit q or an fp32 one. With a
    16-bit q the keys must be values of its dtype or FP8 ones (what the engine writes; an fp32
    cache of other values is rounded to the query's dtype, outside this bound).

    Both compute S[h, l] = sum_d q[h, d] k[l, d] in fp32, in different orders: each product is
    exact in the kernel's 16-bit dot (rounded once in its fp32 one) and rounded at most once in
    the reference (plus once for an FP8 key's scale on each side), and each of the D - 1
    additions errs by at most two ulps of the magnitude carried, so
    |dS| <= (2D + 2) * 2u * sum_d |q k| with u = 2^-24 (two ulps an addition: covers tensor
    cores that truncate instead of rounding). ReLU does not grow it; the weighted sum over H
    heads adds 2H + 2 such roundings of sum_h |w S| on each side."""
    heads, dim = q.shape[1], q.shape[2]
    mass = torch.einsum("bhd,bld->bhl", q.float().abs(), keys.float().abs())  # sum_d |q k|
    weighted = torch.einsum("bh,bhl->bl", weights.float().abs(), mass)
    return weighted * (2 * dim + 2 * heads + 6) * 2 * UNIT_ROUNDOFF
