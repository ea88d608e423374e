"""Triton: the block-FP8 linear, y = x @ W^T with W kept as e4m3 bytes and 128x128 scales.

DeepSeek-V3's recipe (DeepGEMM `fp8_gemm_nt`): the activation is quantised per token and 128
columns (`act_quant`, one fp32 scale per 1x128 group), the weight per 128x128 block. A program
owns a BLOCK_M x 128 output tile and walks K in steps of 128: one e4m3 x e4m3 `tl.dot` into fp32
per step, times the activation scale (per row) and the weight block's scale. Partial edge blocks
are masked (zeros), as the checkpoint's partial scale blocks expect.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
BLOCK = 128


def act_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [M, K], fp32 scales [M, ceil(K/128)]) per 1x128 group."""
    m, k = x.shape
    padded = torch.nn.functional.pad(x.float(), (0, -k % BLOCK)).view(m, -1, BLOCK)
    amax = padded.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (padded / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8).view(m, -1)[:, :k]
    return q.contiguous(), scale.squeeze(-1).contiguous()


@triton.jit
def _fp8_gemm_kernel(
    a_ptr, as_ptr, w_ptr, ws_ptr, out_ptr, M, N, K, KB,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    pm = tl.program_id(0)
    pn = tl.program_id(1)
    rm = pm * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pn * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, KB):
        ks = kb * BLOCK_K + rk
        a = tl.load(a_ptr + rm[:, None] * K + ks[None, :],
                    mask=(rm[:, None] < M) & (ks[None, :] < K), other=0.0)  # fmt: skip
        w = tl.load(w_ptr + rn[:, None] * K + ks[None, :],
                    mask=(rn[:, None] < N) & (ks[None, :] < K), other=0.0)  # fmt: skip
        a_scale = tl.load(as_ptr + rm * KB + kb, mask=rm < M, other=0.0)
        w_scale = tl.load(ws_ptr + pn * KB + kb)
        acc += tl.dot(a, tl.trans(w)) * a_scale[:, None] * w_scale
    tl.store(out_ptr + rm[:, None] * N + rn[None, :], acc,
             mask=(rm[:, None] < M) & (rn[None, :] < N))  # fmt: skip


def fp8_gemm(a8, a_scale, w8, w_scale) -> torch.Tensor:
    """(a8 [M, K] e4m3, a_scale [M, K/128]) x (w8 [N, K] e4m3, w_scale [N/128, K/128]) -> fp32."""
    m, k = a8.shape
    n = w8.shape[0]
    out = torch.empty(m, n, dtype=torch.float32, device=a8.device)
    if m == 0:
        return out
    block_m = 16 if m <= 16 else 64
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, BLOCK))
    _fp8_gemm_kernel[grid](
        a8, a_scale, w8.contiguous(), w_scale.float().contiguous(), out, m, n, k,
        triton.cdiv(k, BLOCK), BLOCK_M=block_m, BLOCK_N=BLOCK, BLOCK_K=BLOCK,
    )  # fmt: skip
    return out


def fp8_linear(x, w8, scale_inv, bias=None) -> torch.Tensor:
    """x [..., K] @ dequant(w8 [N, K], scale_inv)^T (+ bias), in x's dtype."""
    lead = x.shape[:-1]
    a8, a_scale = act_quant(x.reshape(-1, x.shape[-1]))
    y = fp8_gemm(a8, a_scale, w8, scale_inv).to(x.dtype).view(*lead, w8.shape[0])
    return y if bias is None else y + bias
