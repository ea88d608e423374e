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
A grouped FP8 Triton GEMM would replace both on CUDA (`--moe-runner-backend`, not built yet).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dsaserve.layers.moe import Experts


def gathered_form(tokens: int, top_k: int, experts: int) -> bool:
    """Whether the gathered form runs (fewer assignments than half the experts)."""
    return 2 * tokens * top_k <= experts


def static_experts(
    experts: Experts, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """sum_j weights[t, j] * expert_{index[t, j]}(x[t]) for every row t: [T, H] in x's dtype.
    index, weights [T, k] from the router; every expert is local (one rank, no EP)."""
    tokens, top_k = index.shape
    if gathered_form(tokens, top_k, experts.gate_up_proj.shape[0]):
        return _gathered(experts, x, index, weights)
    return _dense(experts, x, index, weights)


def _gathered(experts: Experts, x, index, weights) -> torch.Tensor:
    tokens, top_k = index.shape
    flat = index.reshape(-1)  # [T*k]
    rows = x.repeat_interleave(top_k, dim=0)[:, None, :]  # [T*k, 1, H]
    gate_up = experts.gate_up_proj.index_select(0, flat)  # [T*k, 2I, H]
    gate, up = torch.bmm(rows, gate_up.transpose(1, 2)).chunk(2, dim=-1)  # [T*k, 1, I]
    down = experts.down_proj.index_select(0, flat)  # [T*k, H, I]
    y = torch.bmm(F.silu(gate) * up, down.transpose(1, 2))[:, 0]  # [T*k, H]
    y = y.view(tokens, top_k, -1) * weights.to(y.dtype)[..., None]
    return y.sum(dim=1).to(x.dtype)


def _dense(experts: Experts, x, index, weights) -> torch.Tensor:
    count = experts.gate_up_proj.shape[0]
    dense = x.new_zeros(x.shape[0], count).scatter_(1, index, weights.to(x.dtype))  # [T, E]
    rows = x.expand(count, -1, -1)  # [E, T, H] (a view)
    gate, up = torch.bmm(rows, experts.gate_up_proj.transpose(1, 2)).chunk(2, dim=-1)
    y = torch.bmm(F.silu(gate) * up, experts.down_proj.transpose(1, 2))  # [E, T, H]
    return torch.einsum("te,eth->th", dense, y)
