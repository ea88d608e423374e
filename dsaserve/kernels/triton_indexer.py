"""Triton: the DSA indexer's decode scores, read straight from the pool, then top-k.

One program scores BLOCK_L candidate entries of one decode row for every indexer head:
S[h, l] = q[h] . k[l] as fp32 `tl.dot`s over CHUNK_D of the key at a time (heads padded to 16 by
masking; the chunks chain through the accumulator, so the sum runs in the order of one dot, and
no thread holds a whole 128-wide row: 64 heads compile without spills), then
I[l] = sum_h w[h] * ReLU(S[h, l]). Keys are read through the row's slot table from a float
cache or the FP8 layout (e4m3 bytes + a per-token fp32 scale, kernels/kv_quant.py). The top-k is
`topk_earliest` over these scores, so equal scores keep the earlier position, exactly as the
reference does (docs/determinism.md). The dot is IEEE fp32 (no TF32 on GPU): the selection should
be the reference's, not merely close to it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsaserve.kernels.gpu_target import fp8_in_hardware
from dsaserve.kernels.kv_quant import is_fp8
from dsaserve.kernels.topk import topk_earliest
from dsaserve.kernels.triton_support import load_e4m3

BLOCK_L = 64
CHUNK_D = 32  # the dot's K a step: IEEE fp32 dots are FMAs whose operands sit in registers


@triton.jit(do_not_specialize=["L"])
def _indexer_scores_kernel(
    q_ptr, w_ptr, cache_ptr, scale_ptr, slots_ptr, valid_ptr, out_ptr,
    H, L, cache_stride, scale_stride,
    D: tl.constexpr, FP8: tl.constexpr, SOFT_FP8: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_L: tl.constexpr, CHUNK_D: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    ls = tl.program_id(1) * BLOCK_L + tl.arange(0, BLOCK_L)
    hs = tl.arange(0, BLOCK_H)
    in_l = ls < L
    w = tl.load(w_ptr + b * H + hs, mask=hs < H, other=0.0)
    slot = tl.load(slots_ptr + b * L + ls, mask=in_l, other=0).to(tl.int64)
    valid = tl.load(valid_ptr + b * L + ls, mask=in_l, other=0) != 0
    if FP8:
        key_scale = tl.load(scale_ptr + slot * scale_stride, mask=in_l, other=0.0)
    s = tl.zeros((BLOCK_H, BLOCK_L), dtype=tl.float32)
    for d0 in tl.static_range(0, BLOCK_D, CHUNK_D):  # K in chunks: same order as one dot
        ds = d0 + tl.arange(0, CHUNK_D)
        q = tl.load(q_ptr + b * H * D + hs[:, None] * D + ds[None, :],
                    mask=(hs[:, None] < H) & (ds[None, :] < D), other=0.0)  # fmt: skip
        kptr = cache_ptr + slot[:, None] * cache_stride + ds[None, :]
        kmask = in_l[:, None] & (ds[None, :] < D)
        if FP8:
            k = load_e4m3(kptr, kmask, SOFT_FP8) * key_scale[:, None]
        else:
            k = tl.load(kptr, mask=kmask, other=0.0).to(tl.float32)
        s = tl.dot(q, tl.trans(k), s, input_precision="ieee")  # [BLOCK_H, BLOCK_L]
    score = tl.sum(tl.maximum(s, 0.0) * w[:, None], axis=0)
    score = tl.where(valid, score, float("-inf"))
    tl.store(out_ptr + b * L + ls, score, mask=in_l)


def indexer_scores(q, weights, cache, slots, valid) -> torch.Tensor:
    """Scores [B, L] fp32 of decode rows q [B, H, D] (weights [B, H] with the scales folded
    in) over the index keys at `slots` [B, L]; -inf where not `valid`."""
    b, h, d = q.shape
    length = slots.shape[1]
    out = torch.empty(b, length, dtype=torch.float32, device=q.device)
    if b == 0 or length == 0:
        return out
    fp8 = is_fp8(cache)
    scales = cache.view(torch.float32) if fp8 else cache  # per-token scale: the last 4 bytes
    scale_ptr = scales[:, -1] if fp8 else cache
    block_h = max(16, triton.next_power_of_2(h))
    grid = (b, triton.cdiv(length, BLOCK_L))
    _indexer_scores_kernel[grid](
        q.float().contiguous(), weights.float().contiguous(), cache, scale_ptr,
        slots.contiguous(), valid.to(torch.int8).contiguous(), out,
        h, length, cache.stride(0), scales.stride(0) if fp8 else 0,
        D=d, FP8=fp8, SOFT_FP8=fp8 and not fp8_in_hardware(q.device), BLOCK_H=block_h,
        BLOCK_D=max(CHUNK_D, triton.next_power_of_2(d)), BLOCK_L=BLOCK_L, CHUNK_D=CHUNK_D,
        num_warps=8 if block_h >= 64 else 4,
    )  # fmt: skip
    return out


def indexer_decode_topk(q, weights, cache, slots, valid, k: int) -> torch.Tensor:
    """Top-k positions [B, k] into slots' columns; equal scores keep the earlier position."""
    return topk_earliest(indexer_scores(q, weights, cache, slots, valid), k)
