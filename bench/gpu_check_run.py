"""The torch / Triton half of bench/gpu_check.py: the kernel checks (bench/gpu_check_kernels.py),
and the decode step of a random FP8 rank slice (the engine's model classes) timed through the
engine's CUDA-graph runner."""

from __future__ import annotations

import time

import torch
from gpu_check_kernels import DEVICE, _check, _rel, run_checks  # noqa: F401 (run_checks: the script's)
from torch import nn

from dsaserve.engine.decode.cuda_graph import CudaGraphRunner
from dsaserve.engine.kvcache.pool import KVPool
from dsaserve.kernels.block_fp8 import FP8_DTYPE
from dsaserve.kernels.registry import Kernels
from dsaserve.layers.forward_batch import ForwardBatch
from dsaserve.layers.fp8_experts import Fp8Experts
from dsaserve.layers.fp8_linear import keep_fp8
from dsaserve.layers.moe import MoE, Router
from dsaserve.model_config import ModelConfig
from dsaserve.models.dsa_moe import DsaMoeForCausalLM, index_cache_ids


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
    names = {op: "triton" for op in ("indexer", "sparse_mla", "moe", "fp8_gemm", "draft_attention")}
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
