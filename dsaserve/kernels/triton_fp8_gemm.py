"""Triton: the block-FP8 linear, y = x @ W^T with W kept as e4m3 bytes and 128x128 scales.

DeepSeek-V3's recipe (DeepGEMM `fp8_gemm_nt`): the activation is quantised per token and 128
columns (`act_quant`, one fp32 scale per 1x128 group), the weight per 128x128 block. A program
owns a BLOCK_M x 128 output tile (kernels/triton_tile.py: one e4m3 dot per 128 of K, times both
scales; swap-AB below 64 rows, so decode steps run on wgmma / tcgen05 too). Partial edge blocks
are masked (zeros), as the checkpoint's partial scale blocks expect.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsaserve.kernels.triton_tile import gemm_tile, operands, tile

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


@triton.jit(do_not_specialize=["M", "KB"])
def _fp8_gemm_kernel(
    a_ptr, as_ptr, w_ptr, ws_ptr, out_ptr, M, N, K, KB,
    IS_FP8: tl.constexpr, SOFT_FP8: tl.constexpr, IEEE: tl.constexpr, SWAP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    pn = tl.program_id(1)
    rn = pn * BLOCK_N + tl.arange(0, BLOCK_N)
    gemm_tile(a_ptr, as_ptr, w_ptr, ws_ptr + pn * KB, out_ptr, rm, rm, rm < M, rn, N, K, KB,
              IS_FP8, SOFT_FP8, IEEE, SWAP, BLOCK_M, BLOCK_N, BLOCK_K)  # fmt: skip


def fp8_gemm(a8, a_scale, w8, w_scale) -> torch.Tensor:
    """(a8 [M, K] e4m3, a_scale [M, K/128]) x (w8 [N, K] e4m3, w_scale [N/128, K/128]) -> fp32."""
    m, k = a8.shape
    n = w8.shape[0]
    out = torch.empty(m, n, dtype=torch.float32, device=a8.device)
    if m == 0:
        return out
    t = tile(16 if m <= 16 else 64, a8.dtype, w8.dtype, a8.device)
    a8, w8 = operands(a8, w8.contiguous(), t)
    grid = (triton.cdiv(m, t.BLOCK_M), triton.cdiv(n, t.BLOCK_N))
    _fp8_gemm_kernel[grid](a8, a_scale, w8, w_scale.float().contiguous(), out, m, n, k,
                           triton.cdiv(k, BLOCK), **t._asdict())  # fmt: skip
    return out


def fp8_linear(x, w8, scale_inv, bias=None) -> torch.Tensor:
    """x [..., K] @ dequant(w8 [N, K], scale_inv)^T (+ bias), in x's dtype."""
    lead = x.shape[:-1]
    a8, a_scale = act_quant(x.reshape(-1, x.shape[-1]))
    y = fp8_gemm(a8, a_scale, w8, scale_inv).to(x.dtype).view(*lead, w8.shape[0])
    return y if bias is None else y + bias
