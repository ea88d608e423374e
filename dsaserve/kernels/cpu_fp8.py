"""Block-FP8 weights kept as stored on CPU: the `cpu` backend of the `fp8_gemm` and `moe` ops.

On CPU, `auto` keeps a 128x128 block-FP8 checkpoint's quantised Linears and routed experts e4m3
(models/fp8_keep.py), so resident weight bytes are the checkpoint's. The native decode reads them
as stored, dequantising in registers (kernels/cpu_decode_math.h). The layered path (prefill,
mixed batches, the layouts the native decode does not run) comes here, and dequantises a tile at
a time into a transient: a block of `ROWS` weight rows, or one busy expert, in the activations'
dtype. Those values are the ones `--fp8-gemm-backend torch` / `--moe-runner-backend torch` make
once at load (`dequantize_block_fp8(...).to(dtype)`), so the two agree to the GEMMs' rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dsaserve.kernels.block_fp8 import FP8_DTYPE, KEPT_BLOCK, dequantize_block_fp8
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


def fp8_experts(experts: nn.Module, x: torch.Tensor, index: torch.Tensor,
                weights: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """sum_j weights[t, j] * expert_{index[t, j]}(x[t]): FP8 experts one busy expert at a time
    (index -1: another rank's, left out); float ones as the torch op."""
    if experts.gate_up_proj.dtype != FP8_DTYPE:
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
    w8, scale = getattr(experts, name)[expert], getattr(experts, f"{name}_scale_inv")[expert]
    return dequantize_block_fp8(w8, scale).to(dtype)
