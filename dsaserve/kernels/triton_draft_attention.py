"""Triton: a DFlash drafter's block attention, its context read straight from the pool's slots.

Same contract as the torch reference (`kernels/draft_attention.py`). One program per (request,
KV head): its query tile is every block row of every query head that reads this KV head
(B x G rows), which walks the request's context entries in blocks of BLOCK_N through the slot
table with an online softmax (fp32 `tl.dot`s), then the block's own keys and values under
`block_allowed`, and writes the normalised output. The context entry of a slot is
[K of every KV head ‖ V of every KV head]; slots of disallowed entries are never read.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsaserve.kernels import triton_support  # noqa: F401 (under the interpreter: its bf16 dot)

BLOCK_N = 32


@triton.jit
def _attend_tile(q, k, v, ok, m_i, denom, acc, sm_scale, IEEE: tl.constexpr):
    """One online-softmax step over a tile of keys k and values v [N, D] where ok [M, N]: fp32
    IEEE dots for fp32 inputs, else 16-bit tensor-core dots accumulating in fp32."""
    if IEEE:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    s = tl.where(ok, s * sm_scale, -1e30)
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    p = tl.where(ok, tl.exp(s - m_new[:, None]), 0.0)
    alpha = tl.exp(m_i - m_new)
    denom = denom * alpha + tl.sum(p, axis=1)
    if IEEE:
        pv = tl.dot(p, v, input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    return m_new, denom, acc * alpha[:, None] + pv


@triton.jit
def _draft_attention_kernel(
    q_ptr, cache_ptr, slots_ptr, allowed_ptr, k_ptr, v_ptr, block_allowed_ptr, out_ptr,
    L, B, KV, D, sm_scale, cache_stride,
    G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_B: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0)
    h = tl.program_id(1)
    ms = tl.arange(0, BLOCK_M)  # tile row m: block row m // G, query head h * G + m % G
    rows, heads = ms // G, h * G + ms % G
    in_m = rows < B
    ds = tl.arange(0, BLOCK_D)
    in_d = ds < D
    # q [R, B, KV * G, D]
    q = tl.load(q_ptr + ((r * B + rows[:, None]) * KV * G + heads[:, None]) * D + ds[None, :],
                mask=in_m[:, None] & in_d[None, :], other=0.0)  # fmt: skip
    q = q.to(tl.float32) if IEEE else q.to(cache_ptr.dtype.element_ty)
    m_i = tl.full((BLOCK_M,), -1e30, dtype=tl.float32)
    denom = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    for start in range(0, L, BLOCK_N):
        ns = start + tl.arange(0, BLOCK_N)
        in_n = ns < L
        ok = tl.load(allowed_ptr + (r * B + rows[:, None]) * L + ns[None, :],
                     mask=in_m[:, None] & in_n[None, :], other=0) != 0  # fmt: skip
        any_row = tl.max(ok.to(tl.int32), axis=0) > 0
        slot = tl.load(slots_ptr + r * L + ns, mask=in_n & any_row, other=0).to(tl.int64)
        kv_mask = (in_n & any_row)[:, None] & in_d[None, :]
        base = cache_ptr + slot[:, None] * cache_stride + ds[None, :]
        k = tl.load(base + h * D, mask=kv_mask, other=0.0)
        v = tl.load(base + (KV + h) * D, mask=kv_mask, other=0.0)
        m_i, denom, acc = _attend_tile(q, k.to(q.dtype), v.to(q.dtype), ok, m_i, denom, acc,
                                       sm_scale, IEEE)  # fmt: skip
    bs = tl.arange(0, BLOCK_B)
    in_b = bs < B
    ok = tl.load(block_allowed_ptr + rows[:, None] * B + bs[None, :],
                 mask=in_m[:, None] & in_b[None, :], other=0) != 0  # fmt: skip
    kv_off = ((r * B + bs[:, None]) * KV + h) * D + ds[None, :]  # k_block, v_block [R, B, KV, D]
    k = tl.load(k_ptr + kv_off, mask=in_b[:, None] & in_d[None, :], other=0.0).to(q.dtype)
    v = tl.load(v_ptr + kv_off, mask=in_b[:, None] & in_d[None, :], other=0.0).to(q.dtype)
    m_i, denom, acc = _attend_tile(q, k, v, ok, m_i, denom, acc, sm_scale, IEEE)
    out = acc / tl.maximum(denom, 1e-30)[:, None]
    tl.store(out_ptr + ((r * B + rows[:, None]) * KV * G + heads[:, None]) * D + ds[None, :],
             out, mask=in_m[:, None] & in_d[None, :])  # fmt: skip


def draft_attention(q, cache, ctx_slots, ctx_allowed, k_block, v_block, block_allowed,
                    scale: float) -> torch.Tensor:  # fmt: skip
    rows, block, heads, dim = q.shape
    kv_heads = k_block.shape[2]
    groups = heads // kv_heads
    out = torch.empty(rows, block, heads, dim, dtype=torch.float32, device=q.device)
    if rows == 0:
        return out.to(q.dtype)
    length = ctx_slots.shape[1]
    _draft_attention_kernel[(rows, kv_heads)](
        q.contiguous(), cache, ctx_slots.contiguous(), ctx_allowed.to(torch.int8).contiguous(),
        k_block.contiguous(), v_block.contiguous(), block_allowed.to(torch.int8).contiguous(),
        out, length, block, kv_heads, dim, scale, cache.stride(0),
        G=groups, BLOCK_M=max(16, triton.next_power_of_2(block * groups)), BLOCK_N=BLOCK_N,
        BLOCK_D=max(16, triton.next_power_of_2(dim)),
        BLOCK_B=max(16, triton.next_power_of_2(block)), IEEE=cache.dtype == torch.float32,
        num_warps=8 if dim >= 128 else 4,  # 128-wide heads: more warps, no spills
    )  # fmt: skip
    return out.to(q.dtype)
