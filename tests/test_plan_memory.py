"""Memory figures of `dsaserve plan`, checked against hand computation from the configs."""

from __future__ import annotations

import pytest

from dsaserve.deploy.fit import memory_report
from dsaserve.deploy.layout import Layout, PlanRequest
from dsaserve.deploy.memory import (
    FP8_BYTES,
    kv_bytes_per_token,
    layer_split_kv_bytes_per_token,
    main_params,
    mtp_params,
    weight_bytes,
    weight_bytes_per_gpu,
)
from dsaserve.deploy.models import BUILTIN_MODELS
from dsaserve.deploy.planner import plan
from dsaserve.deploy.render import render_plan

GLM = BUILTIN_MODELS["GLM-5.3"]
DSV32 = BUILTIN_MODELS["DeepSeek-V3.2"]
GIB = 1 << 30

# GLM-5 by hand (model.md §1): H 6144, 64 heads, q_lora 2048, kv_lora 512, nope 192, rope 64, v 256
GLM_MLA = 6144 * 2048 + 2048 * 64 * 256 + 6144 * 576 + 512 * 64 * 448 + 64 * 256 * 6144
GLM_INDEXER = 2048 * 32 * 128 + 6144 * 128 + 6144 * 32  # wq_b + wk + weights_proj
GLM_EXPERT = 3 * 6144 * 2048
GLM_MOE = 257 * GLM_EXPERT + 256 * 6144 + 256  # 256 routed + 1 shared + router gate and bias
GLM_DENSE = 3 * 6144 * 12288
GLM_NORMS = 2 * 6144 + 2048 + 512 + 2 * 128  # layer norms, q_a/kv_a norms, indexer k_norm
GLM_LAYER_COMMON = GLM_MLA + GLM_INDEXER + GLM_NORMS
GLM_MAIN = (
    2 * 154880 * 6144  # embed_tokens + lm_head
    + 6144  # final norm
    + 3 * (GLM_LAYER_COMMON + GLM_DENSE)
    + 75 * (GLM_LAYER_COMMON + GLM_MOE)
)
GLM_MTP = GLM_LAYER_COMMON + GLM_MOE + 2 * 6144 * 6144 + 3 * 6144  # + eh_proj, e/h/head norms


def test_glm_component_sizes_match_model_md():
    assert GLM_MLA / 1e6 == pytest.approx(165.02, abs=0.01)
    assert GLM_INDEXER / 1e6 == pytest.approx(9.37, abs=0.01)
    assert GLM_EXPERT / 1e6 == pytest.approx(37.75, abs=0.01)
    assert GLM_MOE / 1e9 == pytest.approx(9.703, abs=0.001)


def test_param_counts_from_config_match_hand_computation():
    assert main_params(GLM).total() == GLM_MAIN
    assert mtp_params(GLM).total() == GLM_MTP
    assert GLM_MAIN / 1e9 == pytest.approx(743.9, abs=0.05)
    assert (GLM_MAIN + GLM_MTP) / 1e9 == pytest.approx(753.9, abs=0.05)


def test_deepseek_v32_param_counts():
    assert main_params(DSV32).total() / 1e9 == pytest.approx(671.9, abs=0.05)
    total = (main_params(DSV32) + mtp_params(DSV32)).total()
    assert total / 1e9 == pytest.approx(683.5, abs=0.05)


@pytest.mark.parametrize(
    "model, precision, tb",
    [(GLM, "fp8", 0.76), (GLM, "bf16", 1.51), (DSV32, "fp8", 0.69), (DSV32, "bf16", 1.37)],
)
def test_checkpoint_sizes(model, precision, tb):
    counts = main_params(model) + mtp_params(model)
    assert weight_bytes(counts, precision).total() / 1e12 == pytest.approx(tb, abs=0.006)


def test_bf16_bytes_are_two_per_param_and_fp8_one_plus_block_scales():
    counts = main_params(GLM)
    assert weight_bytes(counts, "bf16").total() == 2 * GLM_MAIN
    bf16_kept = 2 * 154880 * 6144 + counts.attention_kept + counts.replicated
    fp8_part = GLM_MAIN - bf16_kept
    expected = fp8_part * FP8_BYTES + 2 * bf16_kept
    assert weight_bytes(counts, "fp8").total() == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize(
    "model, kv_dtype, expected",
    [
        (GLM, "bf16", 78 * ((512 + 64) * 2 + 128 + 4)),  # 100,152 B
        (GLM, "fp8_e4m3", 78 * (512 + 16 + 128 + 132)),  # 61,464 B
        (DSV32, "bf16", 78_324),
        (DSV32, "fp8_e4m3", 48_068),
    ],
)
def test_kv_bytes_per_token(model, kv_dtype, expected):
    assert kv_bytes_per_token(model, kv_dtype) == expected


def test_kv_headline_values():
    assert kv_bytes_per_token(GLM, "bf16") == 100_152
    assert kv_bytes_per_token(GLM, "fp8_e4m3") == 61_464
    # the MTP layer keeps its own entries: one more layer
    assert kv_bytes_per_token(GLM, "bf16", with_mtp=True) == 79 * 1284


def _everywhere(b) -> int:
    """Replicated on every rank: norms, router, eh_proj, and (as SGLang keeps them) q_a_proj,
    kv_a_proj_with_mqa and the indexer."""
    return b.replicated + b.attention_kept + b.attention_replicated


def test_plain_tp_splits_everything_but_replicated_parts():
    b = weight_bytes(main_params(GLM), "bf16")
    per_gpu = weight_bytes_per_gpu(GLM, "bf16", tp=8, attn_tp=8, with_mtp=False)
    assert per_gpu == pytest.approx((b.total() - _everywhere(b)) / 8 + _everywhere(b), abs=2)


def test_dp_attention_replicates_attention_and_embedding():
    b = weight_bytes(main_params(GLM), "fp8")
    plain = weight_bytes_per_gpu(GLM, "fp8", tp=8, attn_tp=8, with_mtp=False)
    dp_attn = weight_bytes_per_gpu(GLM, "fp8", tp=8, attn_tp=1, with_mtp=False)
    replicated = b.attention + b.embedding
    assert dp_attn - plain == pytest.approx(replicated * 7 / 8, abs=2)


def test_h200_low_latency_fit_by_hand():
    """GLM-5.3 FP8, 8xH200 TP8 with MTP: tokens = (0.8 x 139.8 GiB - weights/8) / 101,436 B."""
    p = plan(PlanRequest(model="GLM-5.3", hardware="H200", recipe="low-latency"))
    r = p.memory
    b = weight_bytes(main_params(GLM) + mtp_params(GLM), "fp8")
    assert r.weight_bytes_total == b.total()
    # split 8 ways except norms, router gates and the MTP eh_proj (0.39 GB), q_a/kv_a and the
    # indexer, on every GPU
    everywhere = _everywhere(b)
    assert r.weight_bytes_per_gpu == pytest.approx((b.total() - everywhere) / 8 + everywhere)
    assert b.replicated / 1e9 == pytest.approx(0.39, abs=0.01)
    budget = int(int(139.8 * GIB) * 0.8)
    assert r.budget_bytes_per_gpu == budget
    assert r.kv_bytes_per_token_served == 101_436
    assert r.tokens_per_rank == (budget - r.weight_bytes_per_gpu) // 101_436
    assert r.kv_ranks == 1
    assert r.concurrency == r.tokens_per_rank // (8192 + 1024)
    assert 200_000 < r.tokens_per_rank < 300_000


def test_dp_attention_multiplies_kv_pools():
    p = plan(PlanRequest(model="GLM-5.3", hardware="H200", recipe="high-throughput"))
    r = p.memory
    assert r.kv_ranks == 8
    assert r.total_tokens == 8 * r.tokens_per_rank
    assert r.concurrency == 8 * (r.tokens_per_rank // 9216)


def test_hicache_host_memory_is_ratio_times_pool():
    p = plan(PlanRequest(hardware="H200", hicache=True))
    r = p.memory
    assert r.hicache_host_bytes_per_gpu == 2 * r.kv_pool_bytes_per_gpu


def test_report_follows_layout_fields():
    p_hw = plan(PlanRequest()).layout.hardware
    lay = Layout(PlanRequest(), GLM, p_hw, nodes=1, tp=8)
    lay.kv_dtype, lay.mem_fraction = "fp8_e4m3", 0.5
    r = memory_report(lay)
    assert r.budget_bytes_per_gpu == int(p_hw.memory_bytes * 0.5)
    assert r.kv_bytes_per_token == 61_464
    assert r.params_mtp == 0


def test_layer_split_kv_per_rank_by_hand():
    """One CP rank under LayerSplit: MLA entries (1152 B bf16) of ceil(L / cp) main layers, one
    scratch layer and the MTP layer; the indexer keys (132 B) of every layer."""
    assert layer_split_kv_bytes_per_token(GLM, "bf16", 8, with_mtp=True) == 12 * 1152 + 79 * 132
    assert layer_split_kv_bytes_per_token(DSV32, "bf16", 8) == 9 * 1152 + 61 * 132
    assert layer_split_kv_bytes_per_token(DSV32, "bf16", 2) == 32 * 1152 + 61 * 132
    assert layer_split_kv_bytes_per_token(DSV32, "fp32", 2) == 32 * 576 * 4 + 61 * 128 * 4


def test_memory_report_shows_layer_split_when_cp_is_planned():
    cp = plan(PlanRequest(context_parallel="interleave"))
    assert (cp.memory.cp_size, cp.memory.kv_bytes_per_token_layer_split) == (8, 24_252)
    assert cp.to_json()["memory"]["kv_bytes_per_token_layer_split"] == 24_252
    row = "KV, LayerSplit   24,252 B per token per CP rank (24%, 8 ranks)"
    assert row in render_plan(cp)
    plain = plan(PlanRequest())
    assert plain.memory.kv_bytes_per_token_layer_split == 0
    assert "LayerSplit" not in render_plan(plain)
