"""Triton: the DSA indexer's decode scores, read straight from the pool, then top-k.

One program scores BLOCK_L candidate entries of one decode row for every indexer head:
S[h, l] = q[h] . k[l] as one fp32 `tl.dot` (heads padded to 16 by masking), then
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

from dsaserve.kernels.kv_quant import is_fp8
from dsaserve.kernels.topk import topk_earliest

BLOCK_L = 32


@triton.jit
def _indexer_scores_kernel(
    q_ptr, w_ptr, cache_ptr, scale_ptr, slots_ptr, valid_ptr, out_ptr,
    H, D, L, cache_stride, scale_stride,
    FP8: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_L: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    lb = tl.program_id(1)
    hs = tl.arange(0, BLOCK_H)
    ds = tl.arange(0, BLOCK_D)
    ls = lb * BLOCK_L + tl.arange(0, BLOCK_L)
    in_l = ls < L
    q = tl.load(q_ptr + b * H * D + hs[:, None] * D + ds[None, :],
                mask=(hs[:, None] < H) & (ds[None, :] < D), other=0.0)  # fmt: skip
    w = tl.load(w_ptr + b * H + hs, mask=hs < H, other=0.0)
    slot = tl.load(slots_ptr + b * L + ls, mask=in_l, other=0).to(tl.int64)
    valid = tl.load(valid_ptr + b * L + ls, mask=in_l, other=0) != 0
    kmask = in_l[:, None] & (ds[None, :] < D)
    kptr = cache_ptr + slot[:, None] * cache_stride + ds[None, :]
    if FP8:
        raw = tl.load(kptr, mask=kmask, other=0)
        k = raw.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        k = k * tl.load(scale_ptr + slot * scale_stride, mask=in_l, other=0.0)[:, None]
    else:
        k = tl.load(kptr, mask=kmask, other=0.0).to(tl.float32)
    s = tl.dot(q.to(tl.float32), tl.trans(k), input_precision="ieee")  # [BLOCK_H, BLOCK_L]
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
    grid = (b, triton.cdiv(length, BLOCK_L))
    _indexer_scores_kernel[grid](
        q.float().contiguous(), weights.float().contiguous(), cache, scale_ptr,
        slots.contiguous(), valid.to(torch.int8).contiguous(), out,
        h, d, length, cache.stride(0), scales.stride(0) if fp8 else 0,
        FP8=fp8, BLOCK_H=max(16, triton.next_power_of_2(h)),
        BLOCK_D=max(16, triton.next_power_of_2(d)), BLOCK_L=BLOCK_L,
    )  # fmt: skip
    return out


def indexer_decode_topk(q, weights, cache, slots, valid, k: int) -> torch.Tensor:
    """Top-k positions [B, k] into slots' columns; equal scores keep the earlier position."""
    return topk_earliest(indexer_scores(q, weights, cache, slots, valid), k)
