"""The kernel half of bench/gpu_check.py: each Triton kernel against the torch reference at one
rank's shapes (indexer, sparse MLA decode at the rank's heads and at 64, block-FP8 GEMM, grouped
FP8 experts in the decode and prefill layouts, bf16 experts). bench/gpu_check_run.py holds the
timing half; bench/gpu_check_compile.py how each of these compiles."""

from __future__ import annotations

import torch
from torch import nn

from dsaserve.kernels import reference
from dsaserve.kernels import triton_fp8_gemm as gemm
from dsaserve.kernels.block_fp8 import dequantize_block_fp8, quantize_block_fp8
from dsaserve.kernels.kv_quant import KV_STORE, quantize_entry, quantize_key
from dsaserve.kernels.static_moe import static_experts
from dsaserve.kernels.triton_indexer import indexer_decode_topk, indexer_scores
from dsaserve.kernels.triton_sparse_mla import sparse_mla_decode

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    finite = want.isfinite()
    got, want = got[finite].double(), want[finite].double()
    return ((got - want).norm() / want.norm().clamp(min=1e-30)).item()


def _check(name: str, error: float, bound: float) -> dict:
    return {"name": name, "error": error, "bound": bound, "ok": error <= bound}


def _gen(seed: int) -> torch.Generator:
    return torch.Generator(device=DEVICE).manual_seed(seed)


def check_indexer(s, context: int, batch: int = 4, q_dtype=torch.bfloat16) -> list[dict]:
    """Scores, top-k and ties of FP8 keys: a bf16 query on tensor cores (the engine's), an fp32
    one as IEEE fp32 dots."""
    g = _gen(context)
    keys = torch.randn(batch * context, s.index_dim, device=DEVICE, generator=g)
    cache = quantize_key(keys)
    table = torch.randperm(batch * context, device=DEVICE, generator=g).view(batch, context)
    valid = torch.ones(batch, context, dtype=torch.bool, device=DEVICE)
    q = torch.randn(batch, s.index_heads, s.index_dim, device=DEVICE, generator=g).to(q_dtype)
    w = torch.randn(batch, s.index_heads, device=DEVICE, generator=g) * s.index_heads**-0.5
    got = indexer_scores(q, w, cache, table, valid)
    want = reference.indexer_scores(q, w, KV_STORE.read_key(cache, table, torch.float32), valid)
    topk = min(s.index_topk, context)
    picks = indexer_decode_topk(q, w, cache, table, valid, topk)
    ref = reference.indexer_decode_topk(q, w, cache, table, valid, topk)
    overlap = sum(len(set(a.tolist()) & set(b.tolist())) for a, b in zip(picks, ref))
    zero = torch.zeros_like(cache)  # every score ties at 0.0: the earliest positions must win
    tied = indexer_decode_topk(q, w.abs(), zero, table, valid, topk)
    earliest = torch.arange(topk, device=DEVICE).expand(batch, -1)
    name = f"{str(q_dtype).removeprefix('torch.')} query ctx {context}"
    return [
        _check(f"indexer scores fp8 keys {name}", _rel(got, want), 1e-4),
        _check(f"indexer top-{topk} overlap {name}", 1 - overlap / picks.numel(), 1e-3),
        _check(f"indexer ties earliest {name}", float(not torch.equal(tied, earliest)), 0),
    ]


def check_sparse_mla(s, batch: int = 4) -> list[dict]:
    """The rank's heads (16-head tiles, mma.sync) and 64 (DP attention's whole GLM-5.3 layer: the
    64-head wgmma / tcgen05 tile over a bf16 cache), bf16 and FP8 caches."""
    g = _gen(1)
    topk, width = s.index_topk, s.rank + s.rope
    entries = torch.randn(batch * topk, width, device=DEVICE, generator=g)
    slots = torch.randperm(batch * topk, device=DEVICE, generator=g).view(batch, topk)
    allowed = torch.rand(batch, topk, device=DEVICE, generator=g) < 0.9
    scale = (s.nope + s.rope) ** -0.5
    out = []
    for heads in sorted({s.heads, 64}):
        q = torch.randn(batch, heads, width, device=DEVICE, generator=g).bfloat16()
        for name, cache in (("bf16", entries.bfloat16()), ("fp8", quantize_entry(entries, s.rank))):
            got = sparse_mla_decode(q, cache, slots, allowed, s.rank, scale)
            want = reference.sparse_mla_decode(q.float(), cache, slots, allowed, s.rank, scale)
            out.append(_check(f"sparse MLA decode {heads} heads {name} cache top-{topk}",
                              _rel(got.float(), want), 2e-2))  # fmt: skip
    return out


def check_gemm(name: str, n: int, k: int, m: int) -> dict:
    g = _gen(n + k)
    w8, scale = quantize_block_fp8(torch.randn(n, k, device=DEVICE, generator=g))
    x = torch.randn(m, k, device=DEVICE, generator=g)
    a8, a_scale = gemm.act_quant(x)
    got = gemm.fp8_gemm(a8, a_scale, w8, scale)
    a = a8.float() * a_scale.repeat_interleave(128, 1)[:, :k]
    return _check(f"fp8 GEMM {name} [{m}x{k}]x[{n}x{k}]",
                  _rel(got, a @ dequantize_block_fp8(w8, scale).T), 1e-4)  # fmt: skip


def _random_experts(r, g: torch.Generator, fp8: bool = True) -> nn.Module:
    experts = nn.Module()
    for weight, shape in (("gate_up_proj", (2 * r.expert_inter, r.hidden)),
                          ("down_proj", (r.hidden, r.expert_inter))):  # fmt: skip
        w = torch.randn(r.experts, *shape, device=DEVICE, generator=g)
        if not fp8:  # the BF16 checkpoint's experts
            setattr(experts, weight, nn.Parameter((w * 0.02).bfloat16(), requires_grad=False))
            continue
        w8, scale = quantize_block_fp8(w)
        setattr(experts, weight, nn.Parameter(w8, requires_grad=False))
        setattr(experts, f"{weight}_scale_inv", nn.Parameter(scale * 0.02, requires_grad=False))
    return experts


def check_moe_bf16(name: str, r, tokens: int) -> dict:
    """bf16 experts (GLM-5.3-BF16) on tensor cores: `auto` (masked swap-AB tiles up to 64 rows,
    contiguous 64-row tiles above) against the torch op in fp32 over the same bf16 values."""
    from dsaserve.kernels.triton_moe import grouped_experts

    g = _gen(r.experts + tokens + 1)
    experts = _random_experts(r, g, fp8=False)
    x = torch.randn(tokens, r.hidden, device=DEVICE, generator=g).bfloat16()
    top_k = min(8, r.experts)
    index = torch.rand(tokens, r.experts, device=DEVICE, generator=g).topk(top_k, dim=-1).indices
    weights = torch.rand(tokens, top_k, device=DEVICE, generator=g)
    got = grouped_experts(experts, x, index, weights).float()
    exact = nn.Module()
    exact.gate_up_proj, exact.down_proj = experts.gate_up_proj.float(), experts.down_proj.float()
    want = static_experts(exact, x.float(), index, weights)
    label = f"{name} grouped bf16 experts ({r.experts} x {r.expert_inter}) batch {tokens}"
    return _check(f"{label} vs fp32 torch", _rel(got, want), 1e-2)


def check_moe(name: str, r, tokens: int) -> list[dict]:
    """The grouped FP8 expert GEMMs (masked and contiguous layouts) against the torch op over
    the dequantised weights (activations unquantised there: e4m3 error) and each other."""
    from dsaserve.kernels.triton_moe import grouped_experts

    g = _gen(r.experts + tokens)
    experts = _random_experts(r, g)
    x = torch.randn(tokens, r.hidden, device=DEVICE, generator=g)
    top_k = min(8, r.experts)
    scores = torch.rand(tokens, r.experts, device=DEVICE, generator=g)
    index = scores.topk(top_k, dim=-1).indices
    weights = torch.rand(tokens, top_k, device=DEVICE, generator=g)
    masked = grouped_experts(experts, x, index, weights, "masked").float()
    contiguous = grouped_experts(experts, x, index, weights, "contiguous").float()
    exact = _quantised_experts(experts, x, index, weights)
    loose = static_experts(experts, x, index, weights)
    label = f"{name} grouped FP8 experts ({r.experts} x {r.expert_inter}) batch {tokens}"
    # 1e-3, not 1e-5: the hidden activation is re-quantised between the GEMMs, and a value a
    # rounding away from an e4m3 boundary flips by 1/16 when the sum order differs
    return [_check(f"{label} vs quantised torch", _rel(masked, exact), 1e-3),
            _check(f"{label} contiguous vs quantised torch", _rel(contiguous, exact), 1e-3),
            _check(f"{label} vs unquantised activations", _rel(masked, loose), 0.1)]  # fmt: skip


def check_moe_prefill(name: str, r, tokens: int) -> dict:
    """The prefill layout (`auto` above MASKED_MAX_TOKENS rows: contiguous, one launch a GEMM
    over every expert's sorted run) at a prefill chunk, routing skewed so that half the experts
    get no token and the rest uneven counts, against the quantised torch math."""
    from dsaserve.kernels.triton_moe import MASKED_MAX_TOKENS, grouped_experts

    g = _gen(r.experts + tokens)
    experts = _random_experts(r, g)
    x = torch.randn(tokens, r.hidden, device=DEVICE, generator=g)
    top_k = min(8, r.experts)
    scores = torch.rand(tokens, r.experts, device=DEVICE, generator=g)
    skewed = r.experts >= 2 * top_k
    if skewed:
        scores[:, r.experts // 2 :] -= 2.0  # never chosen
        scores[:, 0] += 1.0  # in every row
    index = scores.topk(top_k, dim=-1).indices
    weights = torch.rand(tokens, top_k, device=DEVICE, generator=g)
    assert tokens > MASKED_MAX_TOKENS
    got = grouped_experts(experts, x, index, weights).float()
    exact = _quantised_experts(experts, x, index, weights)
    label = f"{name} grouped FP8 experts ({r.experts} x {r.expert_inter}) prefill {tokens} rows"
    label += ", half the experts idle" if skewed else ""
    return _check(f"{label} (contiguous) vs quantised torch", _rel(got, exact), 1e-3)


def _quantised_experts(experts, x, index, weights) -> torch.Tensor:
    """The FP8 op's math in torch, expert by expert: activations quantised per token and 128
    columns before each GEMM, weights dequantised."""

    def dq(a: torch.Tensor) -> torch.Tensor:
        a8, scale = gemm.act_quant(a)
        return a8.float() * scale.repeat_interleave(128, 1)[:, : a.shape[1]]

    out = torch.zeros_like(x)
    a = dq(x)
    for e in index.unique().tolist():
        token, slot = (index == e).nonzero(as_tuple=True)
        w1 = dequantize_block_fp8(experts.gate_up_proj[e], experts.gate_up_proj_scale_inv[e])
        w2 = dequantize_block_fp8(experts.down_proj[e], experts.down_proj_scale_inv[e])
        gate, up = (a[token] @ w1.T).chunk(2, dim=-1)
        y = dq(torch.nn.functional.silu(gate) * up) @ w2.T
        out.index_add_(0, token, y * weights[token, slot, None])
    return out


def run_checks(shapes: dict, contexts: list[int], prefill: int = 4096) -> list[dict]:
    s = shapes["tp"]
    checks = [c for ctx in contexts for dtype in (torch.bfloat16, torch.float32)
              for c in check_indexer(s, ctx, q_dtype=dtype)] + check_sparse_mla(s)  # fmt: skip
    for name, (n, k) in s.linear_shapes().items():
        checks += [check_gemm(name, n, k, m) for m in (1, 64)]
    for moe, r in shapes.items():
        checks.append(check_gemm(f"{moe} expert gate_up", 2 * r.expert_inter, r.hidden, 8))
        checks.append(check_gemm(f"{moe} expert down", r.hidden, r.expert_inter, 8))
        checks += [c for tokens in (1, 32) for c in check_moe(moe, r, tokens)]
        checks += [check_moe_bf16(moe, r, tokens) for tokens in (1, 96)]
        checks.append(check_moe_prefill(moe, r, prefill))
    return checks
