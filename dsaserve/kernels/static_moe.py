"""Routed experts with shapes fixed by the batch size alone: no host synchronisation (capturable).

The layered `Experts.forward` groups assignments by expert on the host (`.tolist()`, `bincount`,
the busiest expert's count as a Python int), so its kernels and their shapes depend on the
routing: a CUDA graph cannot hold it. Here every shape is a function of (tokens T, top-k k,
experts E) only, decided in Python before any data is seen:

- **gathered** (T*k small next to E, e.g. batch 1): each assignment's expert weights are
  gathered ([T*k, 2I, H] and [T*k, H, I]) and one batched GEMM pair runs per assignment; only the
  chosen experts' weights are read (twice: the gather copies them).
- **dense** (otherwise): every expert over every row, weighted by a dense [T, E] routing matrix
  (zero where not chosen); every expert's weights are read once.

Both give the layered path's result up to the order of the k-term sum (fp32: ~1e-7 relative).
This is the torch `moe` op; `--moe-runner-backend triton` runs kernels/triton_moe.py instead
(grouped GEMMs over a masked per-expert table: only the chosen experts' weights are read).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dsaserve.kernels.block_fp8 import FP8_DTYPE, dequantize_block_fp8


def gathered_form(tokens: int, top_k: int, experts: int) -> bool:
    """Whether the gathered form runs (fewer assignments than half the experts)."""
    return 2 * tokens * top_k <= experts


def static_experts(
    experts: nn.Module, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """sum_j weights[t, j] * expert_{index[t, j]}(x[t]) for every row t: [T, H] in x's dtype.
    `experts`: layers/moe.py's `Experts` (its `gate_up_proj` [E, 2I, H], `down_proj` [E, H, I]).
    index, weights [T, k] from the router; every expert is local (one rank, no EP). The torch
    `moe` op (kernels/registry.py); block-FP8 expert weights are dequantised per call."""
    tokens, top_k = index.shape
    gate_up, down = expert_weights(experts, x.dtype)
    if gathered_form(tokens, top_k, gate_up.shape[0]):
        return _gathered(gate_up, down, x, index, weights)
    return _dense(gate_up, down, x, index, weights)


def expert_weights(experts: nn.Module, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """gate_up [E, 2I, H] and down [E, H, I] as float (FP8 ones, with their `*_scale_inv`
    beside them, dequantised)."""
    gate_up, down = experts.gate_up_proj, experts.down_proj
    if gate_up.dtype != FP8_DTYPE:
        return gate_up, down
    return (dequantize_block_fp8(gate_up, experts.gate_up_proj_scale_inv).to(dtype),
            dequantize_block_fp8(down, experts.down_proj_scale_inv).to(dtype))  # fmt: skip


def _gathered(gate_up, down, x, index, weights) -> torch.Tensor:
    tokens, top_k = index.shape
    flat = index.reshape(-1)  # [T*k]
    rows = x.repeat_interleave(top_k, dim=0)[:, None, :]  # [T*k, 1, H]
    chosen = gate_up.index_select(0, flat)  # [T*k, 2I, H]
    gate, up = torch.bmm(rows, chosen.transpose(1, 2)).chunk(2, dim=-1)  # [T*k, 1, I]
    chosen = down.index_select(0, flat)  # [T*k, H, I]
    y = torch.bmm(F.silu(gate) * up, chosen.transpose(1, 2))[:, 0]  # [T*k, H]
    y = y.view(tokens, top_k, -1) * weights.to(y.dtype)[..., None]
    return y.sum(dim=1).to(x.dtype)


def _dense(gate_up, down, x, index, weights) -> torch.Tensor:
    count = gate_up.shape[0]
    dense = x.new_zeros(x.shape[0], count).scatter_(1, index, weights.to(x.dtype))  # [T, E]
    rows = x.expand(count, -1, -1)  # [E, T, H] (a view)
    gate, up = torch.bmm(rows, gate_up.transpose(1, 2)).chunk(2, dim=-1)
    y = torch.bmm(F.silu(gate) * up, down.transpose(1, 2))  # [E, T, H]
    return torch.einsum("te,eth->th", dense, y)
