"""Triton: sparse MLA decode in the absorbed form, straight from the pool's slots.

Every head of a decode row scores the shared cache entries [latent c (R) | rope k_pe (P)] with
its absorbed query [q_lat (R) | q_pe (P)], softmax over the row's allowed entries (its top-k
selection, or its whole context), and returns the attended latent [H, R] (W_UV is applied by the
caller). One program per (row, 16 heads, split of the entries): it walks its split in blocks of
BLOCK_N with an online softmax, two fp32 `tl.dot`s per block for the scores and one for the
output, and leaves its unnormalised partial output with its running max and denominator; a few
tensor ops merge the splits (flash-decoding). The splits keep a batch-1 step with 8 heads a rank
from running on one SM: about TARGET_PROGRAMS programs, each over at least BLOCK_N entries.
Entries are read through the slot table from a float cache or FlashMLA's FP8 layout (e4m3 latent
with one fp32 scale per 128 values, then the bf16 rope; kernels/kv_quant.py). Slots of disallowed
entries are never used, so -1 (FlashMLA's invalid index) or padding is fine there.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsaserve.kernels.kv_quant import group_size, is_fp8

BLOCK_N = 16
BLOCK_H = 16
TARGET_PROGRAMS = 256


@triton.jit
def _sparse_mla_kernel(
    q_ptr, cache_ptr, scale_ptr, rope_ptr, slots_ptr, allowed_ptr, out_ptr, max_ptr, denom_ptr,
    H, L, R, P, sm_scale, cache_stride, scale_stride, scale_offset, rope_stride, rope_offset,
    SPLIT_LEN, NUM_SPLITS,
    FP8: tl.constexpr, GROUP: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    hs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    split = tl.program_id(2)
    begin = split * SPLIT_LEN
    rs = tl.arange(0, BLOCK_R)
    ps = tl.arange(0, BLOCK_P)
    in_h = hs < H
    qrow = q_ptr + b * H * (R + P) + hs[:, None] * (R + P)
    q_lat = tl.load(qrow + rs[None, :], mask=in_h[:, None] & (rs[None, :] < R), other=0.0)
    q_pe = tl.load(qrow + R + ps[None, :], mask=in_h[:, None] & (ps[None, :] < P), other=0.0)
    q_lat = q_lat.to(tl.float32)
    q_pe = q_pe.to(tl.float32)
    m = tl.full((BLOCK_H,), -1e30, dtype=tl.float32)
    denom = tl.zeros((BLOCK_H,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_H, BLOCK_R), dtype=tl.float32)
    for start in range(begin, begin + SPLIT_LEN, BLOCK_N):
        ns = start + tl.arange(0, BLOCK_N)
        ok = tl.load(allowed_ptr + b * L + ns, mask=ns < L, other=0) != 0
        slot = tl.load(slots_ptr + b * L + ns, mask=ok, other=0).to(tl.int64)
        kmask = ok[:, None] & (rs[None, :] < R)
        pmask = ok[:, None] & (ps[None, :] < P)
        if FP8:
            raw = tl.load(cache_ptr + slot[:, None] * cache_stride + rs[None, :], mask=kmask,
                          other=0)  # fmt: skip
            scale = tl.load(scale_ptr + slot[:, None] * scale_stride + scale_offset
                            + rs[None, :] // GROUP, mask=kmask, other=0.0)  # fmt: skip
            k_lat = raw.to(tl.float8e4nv, bitcast=True).to(tl.float32) * scale
        else:
            k_lat = tl.load(cache_ptr + slot[:, None] * cache_stride + rs[None, :], mask=kmask,
                            other=0.0).to(tl.float32)  # fmt: skip
        k_pe = tl.load(rope_ptr + slot[:, None] * rope_stride + rope_offset + ps[None, :],
                       mask=pmask, other=0.0).to(tl.float32)  # fmt: skip
        s = tl.dot(q_lat, tl.trans(k_lat), input_precision="ieee")  # [BH, BN]
        s += tl.dot(q_pe, tl.trans(k_pe), input_precision="ieee")
        s = tl.where(ok[None, :], s * sm_scale, -1e30)
        m_new = tl.maximum(m, tl.max(s, axis=1))
        p = tl.where(ok[None, :], tl.exp(s - m_new[:, None]), 0.0)
        alpha = tl.exp(m - m_new)
        denom = denom * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p, k_lat, input_precision="ieee")
        m = m_new
    part = (b * NUM_SPLITS + split) * H + hs  # [BH] rows of the [B, S, H] partials
    tl.store(out_ptr + part[:, None] * R + rs[None, :], acc,
             mask=in_h[:, None] & (rs[None, :] < R))  # fmt: skip
    tl.store(max_ptr + part, m, mask=in_h)
    tl.store(denom_ptr + part, denom, mask=in_h)


def splits(rows: int, heads: int, length: int) -> tuple[int, int]:
    """(entries per split, splits): about TARGET_PROGRAMS programs, BLOCK_N entries at least."""
    blocks = max(triton.cdiv(length, BLOCK_N), 1)
    want = max(TARGET_PROGRAMS // max(rows * triton.cdiv(heads, BLOCK_H), 1), 1)
    split_len = triton.cdiv(blocks, min(want, blocks)) * BLOCK_N
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
    split_len, num_splits = splits(b, h, length)
    acc = torch.empty(b, num_splits, h, rank, dtype=torch.float32, device=q.device)
    maxes = torch.empty(b, num_splits, h, dtype=torch.float32, device=q.device)
    denoms = torch.empty_like(maxes)
    fp8 = is_fp8(cache)
    if fp8:  # the same bytes seen as fp32 (scales) and bf16 (rope)
        scales, ropes = cache.view(torch.float32), cache.view(torch.bfloat16)
        groups = rank // group_size(rank)
        geometry = (scales.stride(0), rank // 4, ropes.stride(0), (rank + 4 * groups) // 2)
    else:
        scales, ropes = cache, cache
        geometry = (0, 0, cache.stride(0), rank)
    grid = (b, triton.cdiv(h, BLOCK_H), num_splits)
    _sparse_mla_kernel[grid](
        q.contiguous(), cache, scales, ropes, slots.contiguous(),
        allowed.to(torch.int8).contiguous(), acc, maxes, denoms, h, length, rank, rope, scale,
        cache.stride(0), *geometry, split_len, num_splits,
        FP8=fp8, GROUP=group_size(rank), BLOCK_H=BLOCK_H, BLOCK_N=BLOCK_N,
        BLOCK_R=max(16, triton.next_power_of_2(rank)),
        BLOCK_P=max(16, triton.next_power_of_2(rope)),
    )  # fmt: skip
    return merge_splits(acc, maxes, denoms).to(q.dtype)
