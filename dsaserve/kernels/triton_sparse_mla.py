"""Triton: sparse MLA decode in the absorbed form, on tensor cores, straight from the pool's slots.

Every head of a decode row scores the shared cache entries [latent c (R) | rope k_pe (P)] with
its absorbed query [q_lat (R) | q_pe (P)], softmax over the row's allowed entries (its top-k
selection, or its whole context), and returns the attended latent [H, R] (W_UV is applied by the
caller). FlashMLA's structure: a program owns one row's block of BLOCK_H heads (the M of every
dot) and one split of its entries, walked BLOCK_N entries (the N) at a time with an online
softmax. Per block: S = q_lat . c^T + q_pe . k_pe^T (the 512-wide latent is the K of the first
dot), then acc += P . c with the same entries as the K. The dots run in the query's 16-bit dtype
with fp32 accumulation over any cache (mma.sync for a 16-head tile, wgmma / tcgen05 for 64
heads; fewer heads are padded to the tile by masking, as FlashMLA pads them); an fp32 query keeps
IEEE fp32 dots (the exact path of fp32 engines and the CPU tests). FP8 entries (FlashMLA's
layout: e4m3 latent, one fp32 scale per 128 values, then the bf16 rope; kernels/kv_quant.py) are
dequantised per 128-group in registers before the dots, an fp32 cache's entries rounded to the
query's dtype there (as the reference reads them). MTP verify rows are rows of their own: each
has its own top-k selection, so they share no entry tile to pack.

Each program leaves its unnormalised partial output with its running max and denominator, and a
few tensor ops merge the splits (flash-decoding): about TARGET_PROGRAMS programs, so a batch-1
step with 8 heads a rank does not run on one SM. Slots of disallowed entries are never read, so
-1 (FlashMLA's invalid index) or padding is fine there.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from dsaserve.kernels.gpu_target import fp8_in_hardware, has_wgmma
from dsaserve.kernels.kv_quant import group_size, is_fp8
from dsaserve.kernels.triton_support import load_e4m3

TARGET_PROGRAMS = 256
DOT_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
WIDE_CACHES = (torch.bfloat16, torch.float16)  # read by the 64-head tile (no conversion)


@triton.jit
def _latent(cache_ptr, scale_ptr, slot, ok, cache_stride, scale_stride, scale_offset,
            R: tl.constexpr, FP8: tl.constexpr, SOFT_FP8: tl.constexpr, GROUP: tl.constexpr,
            BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):  # fmt: skip
    """The latents [BLOCK_N, BLOCK_R] of the entries at `slot` (fp32; 0 where not ok)."""
    rs = tl.arange(0, BLOCK_R)
    kmask = ok[:, None] & (rs[None, :] < R)
    ptrs = cache_ptr + slot[:, None] * cache_stride + rs[None, :]
    if FP8:
        k = load_e4m3(ptrs, kmask, SOFT_FP8)
        gs = tl.arange(0, BLOCK_R // GROUP)
        scale = tl.load(scale_ptr + slot[:, None] * scale_stride + scale_offset + gs[None, :],
                        mask=ok[:, None] & (gs[None, :] < R // GROUP), other=0.0)  # fmt: skip
        k = tl.reshape(k, (BLOCK_N, BLOCK_R // GROUP, GROUP)) * scale[:, :, None]
        return tl.reshape(k, (BLOCK_N, BLOCK_R))
    return tl.load(ptrs, mask=kmask, other=0.0).to(tl.float32)


@triton.jit(do_not_specialize=["H", "L", "SPLIT_LEN", "NUM_SPLITS"])
def _sparse_mla_kernel(
    q_ptr, cache_ptr, scale_ptr, rope_ptr, slots_ptr, allowed_ptr, out_ptr, max_ptr, denom_ptr,
    H, L, sm_scale, cache_stride, scale_stride, scale_offset, rope_stride, rope_offset,
    SPLIT_LEN, NUM_SPLITS,
    R: tl.constexpr, P: tl.constexpr, FP8: tl.constexpr, SOFT_FP8: tl.constexpr,
    GROUP: tl.constexpr, DOT: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr,
):  # fmt: skip
    hs = tl.program_id(0) * BLOCK_H + tl.arange(0, BLOCK_H)  # a row's head blocks side by side
    b = tl.program_id(1)
    split = tl.program_id(2)
    rs = tl.arange(0, BLOCK_R)
    ps = tl.arange(0, BLOCK_P)
    in_h = hs < H
    qrow = q_ptr + (b * H + hs[:, None]) * (R + P)
    q_lat = tl.load(qrow + rs[None, :], mask=in_h[:, None] & (rs[None, :] < R), other=0.0)
    q_pe = tl.load(qrow + R + ps[None, :], mask=in_h[:, None] & (ps[None, :] < P), other=0.0)
    q_lat, q_pe = q_lat.to(DOT), q_pe.to(DOT)
    m = tl.full((BLOCK_H,), -1e30, dtype=tl.float32)
    denom = tl.zeros((BLOCK_H,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_H, BLOCK_R), dtype=tl.float32)
    begin = split * SPLIT_LEN
    for start in range(begin, begin + SPLIT_LEN, BLOCK_N):
        ns = start + tl.arange(0, BLOCK_N)
        ok = tl.load(allowed_ptr + b * L + ns, mask=ns < L, other=0) != 0
        slot = tl.load(slots_ptr + b * L + ns, mask=ok, other=0).to(tl.int64)
        k_lat = _latent(cache_ptr, scale_ptr, slot, ok, cache_stride, scale_stride, scale_offset,
                        R, FP8, SOFT_FP8, GROUP, BLOCK_N, BLOCK_R).to(DOT)  # fmt: skip
        k_pe = tl.load(rope_ptr + slot[:, None] * rope_stride + rope_offset + ps[None, :],
                       mask=ok[:, None] & (ps[None, :] < P), other=0.0).to(DOT)  # fmt: skip
        s = tl.dot(q_lat, tl.trans(k_lat), input_precision="ieee")  # [BH, BN]
        s = tl.dot(q_pe, tl.trans(k_pe), s, input_precision="ieee")
        s = tl.where(ok[None, :], s * sm_scale, -1e30)
        m_new = tl.maximum(m, tl.max(s, axis=1))
        p = tl.where(ok[None, :], tl.exp(s - m_new[:, None]), 0.0)
        alpha = tl.exp(m - m_new)
        denom = denom * alpha + tl.sum(p, axis=1)
        acc = tl.dot(p.to(DOT), k_lat, acc * alpha[:, None], input_precision="ieee")
        m = m_new
    part = (b * NUM_SPLITS + split) * H + hs  # [BH] rows of the [B, S, H] partials
    tl.store(out_ptr + part[:, None] * R + rs[None, :], acc,
             mask=in_h[:, None] & (rs[None, :] < R))  # fmt: skip
    tl.store(max_ptr + part, m, mask=in_h)
    tl.store(denom_ptr + part, denom, mask=in_h)


class Tile(NamedTuple):
    """The launch's tile: heads a program (the dots' M), entries a step (N), the dot dtype."""

    block_h: int
    block_n: int
    dot: tl.dtype
    num_warps: int
    num_stages: int


def tile(heads: int, q_dtype: torch.dtype, cache_dtype: torch.dtype, device: torch.device) -> Tile:
    """A 16-bit query: 16-bit dots (tensor cores) over any cache, its entries converted to the
    query's dtype in registers (exact for a 16-bit cache and for the entries a 16-bit engine
    writes into an fp32 one; the reference reads them in that dtype too). 16 heads a program
    (mma.sync: a row's 8 heads of GLM-5.3 at TP8 padded to 16 by masking), or 64 (wgmma on
    sm_90, tcgen05 on sm_100: M = 64 at least) over a 16-bit cache when the row has that many
    heads (an FP8 or fp32 cache's converted tile passes through registers, and at 64 heads
    that spills: 328 / 324 B on sm_90). An fp32 query: IEEE fp32 dots, whose FMA operands sit
    in registers: fewer entries a step."""
    if q_dtype not in DOT_DTYPES:
        return Tile(16, 16, tl.float32, 4, 3)
    dot = DOT_DTYPES[q_dtype]
    if heads >= 64 and cache_dtype in WIDE_CACHES and has_wgmma(device):
        return Tile(64, 16, dot, 8, 2)
    # an fp32 cache's 32 x 512 latent tile held in fp32 before its conversion spills on sm_100
    return Tile(16, 16 if cache_dtype == torch.float32 else 32, dot, 8, 3)


def splits(rows: int, head_blocks: int, length: int, block_n: int) -> tuple[int, int]:
    """(entries per split, splits): about TARGET_PROGRAMS programs, block_n entries at least."""
    blocks = max(triton.cdiv(length, block_n), 1)
    want = max(TARGET_PROGRAMS // max(rows * head_blocks, 1), 1)
    split_len = triton.cdiv(blocks, min(want, blocks)) * block_n
    return split_len, max(triton.cdiv(length, split_len), 1)


def merge_splits(acc: torch.Tensor, maxes: torch.Tensor, denoms: torch.Tensor) -> torch.Tensor:
    """Partials acc [B, S, H, R], running max and denominator [B, S, H] -> [B, H, R]."""
    weight = torch.exp(maxes - maxes.amax(dim=1, keepdim=True))  # 0 for an empty split
    total = (denoms * weight).sum(dim=1).clamp(min=1e-30)
    return (acc * weight[..., None]).sum(dim=1) / total[..., None]


def sparse_mla_decode(q, cache, slots, allowed, rank: int, scale: float) -> torch.Tensor:
    """q [B, H, R + P] over cache entries `slots` [B, L] where `allowed` -> [B, H, R] (q.dtype)."""
    b, h, width = q.shape
    rope = width - rank
    length = slots.shape[1]
    if b == 0:
        return q.new_empty(0, h, rank)
    fp8 = is_fp8(cache)
    block_h, block_n, dot, num_warps, num_stages = tile(h, q.dtype, cache.dtype, q.device)
    split_len, num_splits = splits(b, triton.cdiv(h, block_h), length, block_n)
    acc = torch.empty(b, num_splits, h, rank, dtype=torch.float32, device=q.device)
    maxes = torch.empty(b, num_splits, h, dtype=torch.float32, device=q.device)
    denoms = torch.empty_like(maxes)
    if fp8:  # the same bytes seen as fp32 (scales) and bf16 (rope)
        scales, ropes = cache.view(torch.float32), cache.view(torch.bfloat16)
        groups = rank // group_size(rank)
        geometry = (scales.stride(0), rank // 4, ropes.stride(0), (rank + 4 * groups) // 2)
    else:
        scales, ropes = cache, cache
        geometry = (0, 0, cache.stride(0), rank)
    grid = (triton.cdiv(h, block_h), b, num_splits)  # a row's head blocks share L2
    _sparse_mla_kernel[grid](
        q.contiguous(), cache, scales, ropes, slots.contiguous(),
        allowed.to(torch.int8).contiguous(), acc, maxes, denoms, h, length, scale,
        cache.stride(0), *geometry, split_len, num_splits,
        R=rank, P=rope, FP8=fp8, SOFT_FP8=fp8 and not fp8_in_hardware(q.device),
        GROUP=group_size(rank), DOT=dot, BLOCK_H=block_h, BLOCK_N=block_n,
        BLOCK_R=max(16, triton.next_power_of_2(rank)),
        BLOCK_P=max(16, triton.next_power_of_2(rope)), num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return merge_splits(acc, maxes, denoms).to(q.dtype)
