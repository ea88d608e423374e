"""Quantised weights kept as stored on CPU: the `cpu` backend of the `fp8_gemm` and `moe` ops.

On CPU, `auto` keeps a 128x128 block-FP8 checkpoint's quantised Linears and routed experts e4m3,
and an NVFP4 checkpoint's routed experts e2m1 (one rank; models/fp8_keep.py), so resident weight
bytes are the checkpoint's. The native decode reads them as stored, dequantising in registers
(kernels/cpu_decode_math.h). The layered path (prefill, mixed batches, the layouts the native
decode does not run) comes here, and dequantises a tile at a time into a transient: a block of
`ROWS` weight rows, or one busy expert, in the activations' dtype. Those values are the ones
`--fp8-gemm-backend torch` / `--moe-runner-backend torch` make once at load
(`dequantize_block_fp8(...)`, or NVFP4's e2m1 * (scale * scale_2), then `.to(dtype)`), so the
two agree to the GEMMs' rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dsaserve.kernels.block_fp8 import FP8_DTYPE, KEPT_BLOCK, dequantize_block_fp8
from dsaserve.kernels.nvfp4 import GROUP, unpack_e2m1
from dsaserve.kernels.static_moe import static_experts

ROWS = 8 * KEPT_BLOCK  # weight rows dequantised at a time


def fp8_linear(x: torch.Tensor, w8: torch.Tensor, scale_inv: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """x @ dequant(w8, scale_inv).T (+ bias), `ROWS` output features at a time."""
    parts = []
    for start in range(0, w8.shape[0], ROWS):
        block = slice(start // KEPT_BLOCK, (start + ROWS) // KEPT_BLOCK)
        w = dequantize_block_fp8(w8[start : start + ROWS], scale_inv[block]).to(x.dtype)
        b = None if bias is None else bias[start : start + ROWS]
        parts.append(F.linear(x, w, b))
    return torch.cat(parts, dim=-1)


def kept_experts(experts: nn.Module, x: torch.Tensor, index: torch.Tensor,
                 weights: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """sum_j weights[t, j] * expert_{index[t, j]}(x[t]): FP8 or NVFP4 experts one busy expert at
    a time (index -1: another rank's, left out); float ones as the torch op."""
    if experts.gate_up_proj.dtype not in (FP8_DTYPE, torch.uint8):  # uint8: NVFP4 codes
        return static_experts(experts, x, index, weights)
    flat, scale = index.reshape(-1), weights.reshape(-1)
    token_of = torch.arange(flat.numel()) // index.shape[1]
    out = torch.zeros_like(x)
    for expert in flat[flat >= 0].unique().tolist():
        picks = (flat == expert).nonzero().squeeze(1)
        rows = token_of[picks]
        gate, up = F.linear(x[rows], _expert(experts, "gate_up_proj", expert, x.dtype)).chunk(2, -1)
        y = F.linear(F.silu(gate) * up, _expert(experts, "down_proj", expert, x.dtype))
        out.index_add_(0, rows, (y * scale[picks, None]).to(x.dtype))
    return out


def _expert(experts: nn.Module, name: str, expert: int, dtype: torch.dtype) -> torch.Tensor:
    stored = getattr(experts, name)[expert]
    if stored.dtype == torch.uint8:  # NVFP4: e2m1 * (scale * each row's scale_2)
        values = unpack_e2m1(stored).unflatten(-1, (-1, GROUP))
        scale = getattr(experts, f"{name}_scale")[expert].float()[..., None]  # [rows, in/16, 1]
        scale_2 = getattr(experts, f"{name}_scale_2")[expert][..., None]  # [rows, 1, 1]
        return (values * (scale * scale_2)).flatten(-2).to(dtype)
    return dequantize_block_fp8(stored, getattr(experts, f"{name}_scale_inv")[expert]).to(dtype)
