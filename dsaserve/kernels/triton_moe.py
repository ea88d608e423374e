"""Triton: routed experts as grouped GEMMs over a per-expert assignment table (the `moe` op).

Two layouts of the T*k routing assignments (token t's j-th expert is assignment t*k + j):

- **masked** (decode, and what a CUDA graph captures): a table [E, T] holding, per expert, its
  assignment ids in its first `counts[e]` entries (DeepGEMM's `m_grouped_fp8_gemm_nt_masked`
  layout). Shapes depend on (T, k, E) only and the table is built with scatters and cumsums,
  so nothing syncs with the host. A program owns (expert, BLOCK_M rows, BLOCK_N columns) and
  returns at once past its expert's count: idle experts' weights are never read.
- **contiguous** (prefill, many tokens): the assignments sorted by expert, each expert's run
  padded to BLOCK_M, one expert id per row block (vLLM / SGLang's `moe_align_block_size`
  layout): about T*k / BLOCK_M busy programs whatever E is. Sized by an upper bound, so it too
  needs no host read.

`auto` (the op's default) takes masked up to MASKED_MAX_TOKENS rows (decode buckets) and
contiguous above (a masked table of a prefill chunk would be [E, T], mostly idle programs).

One kernel serves both: it reads its block's expert and row ids from memory. Rows are gathered
from the activation by assignment id // row_div (the token for gate_up, the assignment for down)
and written at their assignment id, so the two GEMMs chain without a permute. Weights are
block-FP8 (e4m3 [E, N, K] with fp32 [E, N/128, K/128] scales; activations quantised per token and
128 columns, as `triton_fp8_gemm`) or float (bf16 / fp16 on tensor cores, fp32 as IEEE dots); the
tile, swap-AB for the 16-row decode blocks, is kernels/triton_tile.py's. Tests:
tests/test_triton_moe.py against the torch reference under TRITON_INTERPRET=1.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from dsaserve.kernels.triton_fp8_gemm import act_quant
from dsaserve.kernels.triton_tile import gemm_tile, operands, tile

FP8 = torch.float8_e4m3fn
BLOCK = 128  # N and K tile: one FP8 scale block
MASKED_MAX_TOKENS = 64  # `auto` layout: masked up to this many rows, contiguous above


class Layout(NamedTuple):
    """Which rows each program block takes: `rows` [blocks * BLOCK_M] assignment ids (-1 unused)
    and `experts` [blocks] the expert of each block (masked: experts[b] = b // row_blocks)."""

    rows: torch.Tensor
    experts: torch.Tensor
    block_m: int


def masked_layout(index: torch.Tensor, num_experts: int, block_m: int = 16) -> Layout:
    """Per expert, its assignment ids padded to T (a multiple of block_m): no host sync.
    Negative ids (another rank's experts, layers/fp8_experts.py) are left out."""
    tokens, top_k = index.shape
    flat = index.reshape(-1)
    mine = flat >= 0
    safe = flat.clamp(min=0)
    cap = -(-tokens // block_m) * block_m  # an expert appears at most once per token
    hits = torch.zeros(flat.shape[0], num_experts, dtype=torch.int32, device=index.device)
    hits.scatter_(1, safe[:, None], mine[:, None].int())
    slot = (hits.cumsum(0).gather(1, safe[:, None])[:, 0] - 1).long()  # rank within its expert
    slot = torch.where(mine, slot, cap)  # left out: a scratch column, cut off below
    table = torch.full((num_experts, cap + 1), -1, dtype=torch.long, device=index.device)
    table[safe, slot] = torch.arange(flat.shape[0], device=index.device)
    blocks = torch.arange(num_experts * (cap // block_m), device=index.device) // (cap // block_m)
    return Layout(table[:, :cap].reshape(-1), blocks, block_m)


def contiguous_layout(index: torch.Tensor, num_experts: int, block_m: int = 64) -> Layout:
    """Assignments sorted by expert (assignment order within one), each expert's run padded to a
    multiple of block_m, one expert id per row block: SGLang's `moe_align_block_size`. Sized by
    the bound T*k + min(E, T*k) * (block_m - 1) rows, not by the counts, so nothing is read on
    the host (trailing blocks past the last run hold -1 rows only and exit at once). Negative
    ids (another rank's experts) sort last, into a scratch row cut off below."""
    n, device = index.numel(), index.device
    flat = torch.where(index.reshape(-1) >= 0, index.reshape(-1), num_experts)  # E: left out
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    counts = counts[:num_experts]
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)  # each expert's run is [ends - padded, ends)
    order = flat.argsort(stable=True)  # assignment ids grouped by expert
    expert_of = flat[order]
    starts_of = F.pad(counts.cumsum(0) - counts, (0, 1))[expert_of]
    rank = torch.arange(n, device=device) - starts_of
    blocks = -(-(n + min(num_experts, n) * (block_m - 1)) // block_m)
    rows = torch.full((blocks * block_m + 1,), -1, dtype=torch.long, device=device)
    where = F.pad(ends - padded, (0, 1), value=blocks * block_m)[expert_of]
    rows.index_copy_(0, torch.where(expert_of < num_experts, where + rank, where), order)
    rows = rows[:-1]
    starts = torch.arange(blocks, device=device) * block_m
    experts = torch.searchsorted(ends, starts, right=True).clamp_(max=num_experts - 1)
    return Layout(rows, experts, block_m)


@triton.jit(do_not_specialize=["KB", "NB", "row_div"])
def _grouped_kernel(
    a_ptr, as_ptr, w_ptr, ws_ptr, out_ptr, rows_ptr, experts_ptr, N, K, KB, NB, row_div,
    IS_FP8: tl.constexpr, SOFT_FP8: tl.constexpr, IEEE: tl.constexpr, SWAP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    block = tl.program_id(0)
    nb = tl.program_id(1)
    assign = tl.load(rows_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    if tl.max(assign, axis=0) >= 0:  # a block of padding only (an idle expert) reads nothing
        in_m = assign >= 0
        expert = tl.load(experts_ptr + block).to(tl.int64)
        gemm_tile(a_ptr, as_ptr, w_ptr + expert * N * K, ws_ptr + (expert * NB + nb) * KB,
                  out_ptr, tl.where(in_m, assign // row_div, 0), assign, in_m,
                  nb * BLOCK_N + tl.arange(0, BLOCK_N), N, K, KB, IS_FP8, SOFT_FP8, IEEE, SWAP,
                  BLOCK_M, BLOCK_N, BLOCK_K)  # fmt: skip


def grouped_gemm(
    a: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor | None, layout: Layout,
    assignments: int, row_div: int,
) -> torch.Tensor:  # fmt: skip
    """out[i] = a[i // row_div] @ w[expert of i]^T for every assignment i: [assignments, N] fp32.
    a [rows, K] float; w [E, N, K] e4m3 (with w_scale [E, N/128, K/128]) or float."""
    _, n, k = w.shape
    out = torch.zeros(assignments, n, dtype=torch.float32, device=a.device)
    fp8 = w.dtype == FP8
    if fp8:
        a, a_scale = act_quant(a)
        w_scale = w_scale.float().contiguous()
    else:
        a, a_scale, w_scale = a.contiguous(), a, w  # the scale pointers go unused
    t = tile(layout.block_m, a.dtype, w.dtype, a.device)
    a, w = operands(a, w.contiguous(), t)
    grid = (layout.experts.shape[0], triton.cdiv(n, t.BLOCK_N))
    _grouped_kernel[grid](
        a, a_scale, w, w_scale, out, layout.rows, layout.experts,
        n, k, triton.cdiv(k, BLOCK), triton.cdiv(n, BLOCK), row_div, **t._asdict(),
    )  # fmt: skip
    return out


def expert_scales(experts) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The block scales of FP8 expert weights (`gate_up_proj_scale_inv`, `down_proj_scale_inv`
    parameters set beside them), or (None, None) for float weights."""
    if experts.gate_up_proj.dtype != FP8:
        return None, None
    return experts.gate_up_proj_scale_inv, experts.down_proj_scale_inv


def grouped_experts(experts, x, index, weights, layout: str = "auto") -> torch.Tensor:
    """The `moe` op: sum_j weights[t, j] * expert_{index[t, j]}(x[t]) -> [T, H] in x's dtype.
    `masked` (decode), `contiguous` (prefill) or `auto` (by the row count); none syncs."""
    tokens, top_k = index.shape
    count = experts.gate_up_proj.shape[0]
    if layout == "auto":
        layout = "masked" if tokens <= MASKED_MAX_TOKENS else "contiguous"
    build = masked_layout if layout == "masked" else contiguous_layout
    plan = build(index, count)
    gate_scale, down_scale = expert_scales(experts)
    assignments = tokens * top_k
    gate_up = grouped_gemm(x, experts.gate_up_proj, gate_scale, plan, assignments, top_k)
    gate, up = gate_up.chunk(2, dim=-1)  # [T*k, I] each
    hidden = (F.silu(gate) * up).to(x.dtype)
    y = grouped_gemm(hidden, experts.down_proj, down_scale, plan, assignments, 1)  # [T*k, H]
    y = y.view(tokens, top_k, -1) * weights.float()[..., None]
    return y.sum(dim=1).to(x.dtype)
