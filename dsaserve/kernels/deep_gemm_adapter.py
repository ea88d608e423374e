"""DeepGEMM behind the `fp8_gemm` and `moe` seams (`--fp8-gemm-backend deep_gemm`,
`--moe-runner-backend deep_gemm`): thin adapters from our tensors to its calls.

NEVER RUN on a GPU: no machine with DeepGEMM was available to this build. Importing this module
imports `deep_gemm` (PyPI `sgl-deep-gemm`, matched to the torch build); where that fails the
registry falls back to our Triton kernels (CUDA) or refuses the flag (CPU). What is checked, on
CPU (tests/test_kernel_adapters.py), is the plumbing: with a stand-in `deep_gemm` module that
computes the documented contract in torch, the adapters give the Triton kernels' results.

The calls (DeepGEMM's `fp8_gemm_nt` family, NT = both operands K-major):

- `fp8_gemm_nt((a, a_scale), (w, w_scale), out)`: a [M, K] e4m3 with per-token 1x128 scales
  [M, K/128], w [N, K] e4m3 with 128x128 scales, out [M, N] bf16.
- `m_grouped_fp8_gemm_nt_masked((a, a_scale), (w, w_scale), out, masked_m, expected_m)`:
  a [E, M_max, K], out [E, M_max, N]; expert e's first masked_m[e] rows are real (decode).
- `m_grouped_fp8_gemm_nt_contiguous((a, a_scale), (w, w_scale), out, m_indices)`: a [M, K]
  sorted by expert, each expert's run aligned to `get_m_alignment_for_contiguous_layout()`,
  m_indices [M] the expert of each row (-1: padding) (prefill).

The grouping is our own (kernels/triton_moe.py's masked / contiguous layouts, built on the
device with no host read); scales stay fp32 (Hopper's recipe: on Blackwell DeepGEMM wants
UE8M0-packed scales, which this adapter does not produce).
"""

from __future__ import annotations

import deep_gemm
import torch
import torch.nn.functional as F

from dsaserve.kernels import triton_moe
from dsaserve.kernels.triton_fp8_gemm import act_quant
from dsaserve.kernels.triton_moe import MASKED_MAX_TOKENS, contiguous_layout, masked_layout

MASKED_FN = getattr(deep_gemm, "m_grouped_fp8_gemm_nt_masked", None) or getattr(
    deep_gemm, "fp8_m_grouped_gemm_nt_masked", None
)  # the name changed between releases


def fp8_linear(x, w8, scale_inv, bias=None) -> torch.Tensor:
    """The `fp8_gemm` op: x @ dequant(w8, scale_inv).T (+ bias) through `fp8_gemm_nt`."""
    flat = x.reshape(-1, x.shape[-1])
    a8, a_scale = act_quant(flat)
    out = torch.empty(flat.shape[0], w8.shape[0], dtype=torch.bfloat16, device=x.device)
    deep_gemm.fp8_gemm_nt((a8, a_scale), (w8, scale_inv.float()), out)
    y = out.view(*x.shape[:-1], -1).to(x.dtype)
    return y if bias is None else y + bias


def _alignment() -> int:
    get = getattr(deep_gemm, "get_m_alignment_for_contiguous_layout", None)
    return int(get()) if get is not None else 128


def _grouped(a: torch.Tensor, w8, w_scale, rows: torch.Tensor, grouping) -> torch.Tensor:
    """a's rows through each row's expert GEMM; rows [R] (-1: padding), fp32 [R, N] out."""
    a8, a_scale = act_quant(a)
    kind, info = grouping
    n = w8.shape[1]
    if kind == "masked":
        experts = w8.shape[0]
        a8, a_scale = a8.view(experts, -1, a.shape[1]), a_scale.view(experts, -1, a_scale.shape[1])
        out = torch.empty(experts, a8.shape[1], n, dtype=torch.bfloat16, device=a.device)
        MASKED_FN((a8, a_scale), (w8, w_scale), out, *info)
    else:
        out = torch.empty(rows.shape[0], n, dtype=torch.bfloat16, device=a.device)
        deep_gemm.m_grouped_fp8_gemm_nt_contiguous((a8, a_scale), (w8, w_scale), out, info)
    return out.view(rows.shape[0], n).float()


def grouped_experts(experts, x, index, weights, layout: str = "auto") -> torch.Tensor:
    """The `moe` op (FP8 experts, layers/fp8_experts.py): masked (decode) or contiguous.
    Float experts (an unquantised checkpoint) take the Triton kernel instead."""
    gate_scale, down_scale = triton_moe.expert_scales(experts)
    if gate_scale is None:
        return triton_moe.grouped_experts(experts, x, index, weights, layout)
    tokens, top_k = index.shape
    count = experts.gate_up_proj.shape[0]
    if layout == "auto":
        layout = "masked" if tokens <= MASKED_MAX_TOKENS else "contiguous"
    if layout == "masked":
        plan = masked_layout(index, count)
        masked_m = (plan.rows.view(count, -1) >= 0).sum(1).int()
        grouping = ("masked", (masked_m, -(-tokens * top_k // count)))
    else:
        plan = contiguous_layout(index, count, _alignment())
        owner = plan.experts.repeat_interleave(plan.block_m).int()
        grouping = ("contiguous", owner.masked_fill(plan.rows < 0, -1))
    rows, real = plan.rows.clamp(min=0), (plan.rows >= 0)[:, None]
    gate_up = _grouped(x[rows // top_k], experts.gate_up_proj, gate_scale, plan.rows, grouping)
    gate, up = gate_up.chunk(2, dim=-1)
    hidden = (F.silu(gate) * up).to(x.dtype)
    y = _grouped(hidden, experts.down_proj, down_scale, plan.rows, grouping)
    y = torch.where(real, y, 0.0)  # DeepGEMM leaves padding rows unwritten (any bytes)
    out = torch.zeros(tokens * top_k, y.shape[1], dtype=torch.float32, device=x.device)
    out.index_add_(0, rows, y)  # padding rows add zeros (to assignment 0)
    out = out.view(tokens, top_k, -1) * weights.float()[..., None]
    return out.sum(dim=1).to(x.dtype)
