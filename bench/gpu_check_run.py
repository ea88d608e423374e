"""The torch / Triton half of bench/gpu_check.py: kernel checks, and the decode step of a random
FP8 rank slice (the engine's model classes) timed through the engine's CUDA-graph runner."""

from __future__ import annotations

import time

import torch
from torch import nn

from dsaserve.engine.cuda_graph import CudaGraphRunner
from dsaserve.engine.forward_batch import ForwardBatch
from dsaserve.engine.kv_pool import KVPool
from dsaserve.engine.kv_quant import KV_STORE, quantize_entry, quantize_key
from dsaserve.kernels import reference
from dsaserve.kernels import triton_fp8_gemm as gemm
from dsaserve.kernels.fp8_experts import Fp8Experts
from dsaserve.kernels.fp8_linear import keep_fp8
from dsaserve.kernels.registry import Kernels
from dsaserve.kernels.triton_indexer import indexer_decode_topk, indexer_scores
from dsaserve.kernels.triton_sparse_mla import sparse_mla_decode
from dsaserve.layers.moe import MoE, Router
from dsaserve.layers.static_moe import static_experts
from dsaserve.model_config import ModelConfig
from dsaserve.models.dsa_moe import DsaMoeForCausalLM, index_cache_ids
from dsaserve.models.fp8 import FP8_DTYPE, dequantize_block_fp8, quantize_block_fp8

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    finite = want.isfinite()
    got, want = got[finite].double(), want[finite].double()
    return ((got - want).norm() / want.norm().clamp(min=1e-30)).item()


def _check(name: str, error: float, bound: float) -> dict:
    return {"name": name, "error": error, "bound": bound, "ok": error <= bound}


def _gen(seed: int) -> torch.Generator:
    return torch.Generator(device=DEVICE).manual_seed(seed)


def check_indexer(s, context: int, batch: int = 4) -> list[dict]:
    g = _gen(context)
    keys = torch.randn(batch * context, s.index_dim, device=DEVICE, generator=g)
    cache = quantize_key(keys)
    table = torch.randperm(batch * context, device=DEVICE, generator=g).view(batch, context)
    valid = torch.ones(batch, context, dtype=torch.bool, device=DEVICE)
    q = torch.randn(batch, s.index_heads, s.index_dim, device=DEVICE, generator=g)
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
    return [
        _check(f"indexer scores fp8 keys ctx {context}", _rel(got, want), 1e-4),
        _check(f"indexer top-{topk} overlap ctx {context}", 1 - overlap / picks.numel(), 1e-3),
        _check(f"indexer ties earliest ctx {context}", float(not torch.equal(tied, earliest)), 0),
    ]


def check_sparse_mla(s, batch: int = 4) -> list[dict]:
    g = _gen(1)
    topk, width = s.index_topk, s.rank + s.rope
    entries = torch.randn(batch * topk, width, device=DEVICE, generator=g)
    q = torch.randn(batch, s.heads, width, device=DEVICE, generator=g).bfloat16()
    slots = torch.randperm(batch * topk, device=DEVICE, generator=g).view(batch, topk)
    allowed = torch.rand(batch, topk, device=DEVICE, generator=g) < 0.9
    scale = (s.nope + s.rope) ** -0.5
    out = []
    for name, cache in (("bf16", entries.bfloat16()), ("fp8", quantize_entry(entries, s.rank))):
        got = sparse_mla_decode(q, cache, slots, allowed, s.rank, scale)
        want = reference.sparse_mla_decode(q.float(), cache, slots, allowed, s.rank, scale)
        out.append(_check(f"sparse MLA decode {s.heads} heads {name} cache top-{topk}",
                          _rel(got.float(), want), 1e-2))  # fmt: skip
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


def _random_experts(r, g: torch.Generator) -> nn.Module:
    experts = nn.Module()
    for weight, shape in (("gate_up_proj", (2 * r.expert_inter, r.hidden)),
                          ("down_proj", (r.hidden, r.expert_inter))):  # fmt: skip
        w8, scale = quantize_block_fp8(torch.randn(r.experts, *shape, device=DEVICE, generator=g))
        setattr(experts, weight, nn.Parameter(w8, requires_grad=False))
        setattr(experts, f"{weight}_scale_inv", nn.Parameter(scale * 0.02, requires_grad=False))
    return experts


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
    if r.experts >= 2 * top_k:
        scores[:, r.experts // 2 :] -= 2.0  # never chosen
        scores[:, 0] += 1.0  # in every row
    index = scores.topk(top_k, dim=-1).indices
    weights = torch.rand(tokens, top_k, device=DEVICE, generator=g)
    assert tokens > MASKED_MAX_TOKENS
    got = grouped_experts(experts, x, index, weights).float()
    exact = _quantised_experts(experts, x, index, weights)
    label = f"{name} grouped FP8 experts ({r.experts} x {r.expert_inter}) prefill {tokens} rows"
    return _check(f"{label} contiguous, idle experts, vs quantised torch", _rel(got, exact), 1e-3)


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
    from gpu_check import linear_shapes

    s = shapes["tp"]
    checks = [c for ctx in contexts for c in check_indexer(s, ctx)] + check_sparse_mla(s)
    for name, (n, k) in linear_shapes(s).items():
        checks += [check_gemm(name, n, k, m) for m in (1, 64)]
    for moe, r in shapes.items():
        checks.append(check_gemm(f"{moe} expert gate_up", 2 * r.expert_inter, r.hidden, 8))
        checks.append(check_gemm(f"{moe} expert down", r.hidden, r.expert_inter, 8))
        checks += [c for tokens in (1, 32) for c in check_moe(moe, r, tokens)]
        checks.append(check_moe_prefill(moe, r, prefill))
    return checks


def copy_bandwidth() -> float:
    """Bytes a second of a device-to-device copy (read + write)."""
    n = (1 << 30) if DEVICE.type == "cuda" else (1 << 22)
    src = torch.empty(n, dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    dst.copy_(src)
    _sync()
    start = time.perf_counter()
    for _ in range(10):
        dst.copy_(src)
    _sync()
    return 2 * n * 10 / (time.perf_counter() - start)


def _sync() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def rank_config(s) -> ModelConfig:
    """The ModelConfig of one TP rank's slice of the model as a one-rank model: its heads, its
    slice of every expert (TP) or its whole experts (EP), FP8-quantised."""
    raw = dict(
        model_type="glm_moe_dsa", vocab_size=max(s.vocab // 8, 64), hidden_size=s.hidden,
        intermediate_size=s.dense_inter, moe_intermediate_size=s.expert_inter,
        num_hidden_layers=s.layers, num_attention_heads=s.heads, q_lora_rank=s.q_lora,
        kv_lora_rank=s.rank, qk_nope_head_dim=s.nope, qk_rope_head_dim=s.rope,
        v_head_dim=s.v_dim, n_routed_experts=s.experts, num_experts_per_tok=min(8, s.experts),
        n_shared_experts=max(s.shared_inter // s.expert_inter, 1),
        first_k_dense_replace=s.dense_layers, index_topk=s.index_topk,
        index_n_heads=s.index_heads, index_head_dim=s.index_dim, rope_theta=8e6,
        max_position_embeddings=202752, quantization_config={"quant_method": "fp8"},
    )  # fmt: skip
    return ModelConfig._from_dict("gpu_check", raw)


def _fill(name: str, p: torch.Tensor) -> None:
    """Random weights of a plausible scale: e4m3 bytes without NaN patterns, 1e-2 block scales,
    unit norms, N(0, 0.02) elsewhere."""
    if p.dtype == FP8_DTYPE:
        p.view(torch.uint8).random_(0, 256).bitwise_and_(0xB7)
    elif name.endswith("scale_inv"):
        p.fill_(1e-2)
    elif p.dim() == 1:
        p.fill_(1.0 if "norm" in name else 0.0)
    else:
        p.normal_(0, 0.02)


def _to_bf16(model: nn.Module) -> None:
    """The checkpoint's unquantised weights in bf16 (the router and the FP8 scales stay fp32;
    `Module.to` would cast the e4m3 weights too)."""
    for module in model.modules():
        if isinstance(module, Router):
            continue
        for name, p in list(module._parameters.items()):
            if p is not None and p.dtype == torch.float32 and not name.endswith("scale_inv"):
                module._parameters[name] = nn.Parameter(p.to(torch.bfloat16), requires_grad=False)


def rank_model(s, kernels: Kernels) -> DsaMoeForCausalLM:
    """A random FP8 rank slice: every quantised Linear an Fp8Linear, the routed experts FP8 and
    one set shared by every MoE layer (each layer still reads its bytes from HBM: 1.2 GB at
    GLM-5.3's TP8 shapes is far beyond any cache; 75 sets would not fit beside the KV)."""
    with torch.device("meta"):
        model = DsaMoeForCausalLM(rank_config(s))
    keep_fp8(model, kernels.fp8_gemm)
    moe = [layer.mlp for layer in model.model.layers if isinstance(layer.mlp, MoE)]
    if kernels.names["moe"] == "triton":  # held as the engine holds a checkpoint's FP8 experts
        moe[0].experts = Fp8Experts(moe[0].experts, kernels.moe)
    for block in moe[1:]:
        block.experts = moe[0].experts
    _to_bf16(model)
    model.to_empty(device=DEVICE).eval().requires_grad_(False)
    with torch.no_grad():
        for name, p in model.named_parameters():
            _fill(name, p)
        for buffer in model.buffers():
            buffer.zero_()
    model.rotary.inv_freq = model.rotary.inv_freq.to(DEVICE)
    return model


def decode_batch(model, pool: KVPool, kernels: Kernels, batch: int, context: int):
    """Every row at position context - 1 over its own `context` slots (the last one its new)."""
    table = torch.arange(batch * context, device=DEVICE).view(batch, context)
    rows = torch.arange(batch, device=DEVICE)
    vocab = model.config.vocab_size
    return ForwardBatch(
        input_ids=torch.randint(0, vocab, (batch,), device=DEVICE),
        positions=torch.full((batch,), context - 1, device=DEVICE), out_slots=table[:, -1],
        extends=[], decode_rows=rows, decode_slots=table,
        decode_valid=torch.ones(batch, context, dtype=torch.bool, device=DEVICE),
        logits_rows=rows, kv_cache=pool.kv_cache, index_cache=pool.index_cache, kernels=kernels,
    )  # fmt: skip


def triton_kernels() -> Kernels:
    names = {op: "triton" for op in ("indexer", "sparse_mla", "moe", "fp8_gemm")}
    return Kernels({**names, "kv_store": "torch", "sampling": "torch"})


def time_step(model, kernels: Kernels, batch: int, context: int, iters: int) -> dict:
    """One decode step of `batch` rows through the engine's CUDA-graph runner (captured on
    CUDA; on CPU the same static step runs eagerly)."""
    config = model.config
    page = 64
    pages = -(-batch * context // page) + 1  # + the scratch page of the padded rows
    pool = KVPool(config, pages, page, len(index_cache_ids(config, False)), False,
                  torch.bfloat16, DEVICE, fp8=True)  # fmt: skip
    capture = DEVICE.type == "cuda"
    scratch = (pages - 1) * page
    runner = CudaGraphRunner(model, pool, kernels, [batch], context, scratch, capture)
    step = decode_batch(model, pool, kernels, batch, context)
    started = time.perf_counter()
    runner(step)  # capture (Triton compiles in the warm-up)
    _sync()
    capture_s = time.perf_counter() - started
    start = time.perf_counter()
    for _ in range(iters):
        runner(step)
    _sync()
    row = {"batch": batch, "step_ms": (time.perf_counter() - start) / iters * 1e3,
           "cuda_graph": capture, "capture_s": capture_s,
           "replay_check": _replay_check(runner, step)}  # fmt: skip
    del runner, pool, step
    if capture:
        torch.cuda.empty_cache()
    return row


def _replay_check(runner: CudaGraphRunner, step: ForwardBatch) -> dict:
    """The graph's output against the same static step run eagerly on the same inputs (the KV
    writes are the same values both times); the hidden states must be finite."""
    bucket = runner.bucket(step)
    replayed = runner(step)
    runner.inputs.load(bucket, step)
    eager = runner._run(bucket)[: replayed.shape[0]]
    _sync()
    finite = bool(replayed.isfinite().all())
    error = _rel(replayed.float(), eager.float()) if finite else float("inf")
    name = f"decode step {'graph replay' if runner.capture else 'static'} vs eager, batch "
    return _check(name + str(replayed.shape[0]), error, 1e-3)


def run_timing(s, batches: list[int], context: int, iters: int) -> tuple[float, list[dict]]:
    bandwidth = copy_bandwidth()
    kernels = triton_kernels()
    model = rank_model(s, kernels)
    return bandwidth, [time_step(model, kernels, b, context, iters) for b in batches]
