"""Each deployment-guide rule of `dsaserve plan`, stated as a test: when it applies, the plan
names it and carries its effect; when it refuses, the refusal names it."""

from __future__ import annotations

import json
import shlex
from collections.abc import Callable
from pathlib import Path

import pytest

from dsaserve.args import ServerArgs
from dsaserve.deploy.layout import PlanRequest, Refusal
from dsaserve.deploy.planner import RULES, Plan, nearest, plan

# a DSA config small enough to serve on a laptop CPU (fp32, 2 layers, 8 experts, MTP layer)
TINY_CONFIG = dict(
    model_type="glm_moe_dsa", architectures=["GlmMoeDsaForCausalLM"], torch_dtype="float32",
    vocab_size=384, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32,
    kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=24,
    n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
    index_topk=8, index_head_dim=32, index_n_heads=8, max_position_embeddings=4096,
    num_nextn_predict_layers=1,
)  # fmt: skip


def write_tiny_config(folder: Path, **overrides: object) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({**TINY_CONFIG, **overrides}))
    return str(folder)


@pytest.fixture
def tiny_checkpoint(tmp_path: Path) -> str:
    return write_tiny_config(tmp_path / "tiny")


@pytest.fixture
def tiny_checkpoint_no_mtp(tmp_path: Path) -> str:
    return write_tiny_config(tmp_path / "tiny-no-mtp", num_nextn_predict_layers=0)


def serve_args(p: Plan, index: int = 0) -> ServerArgs:
    return ServerArgs.from_cli(shlex.split(p.commands[index].dsaserve)[2:])


def flags(p: Plan) -> str:
    return p.commands[0].dsaserve


R = PlanRequest
# rule name -> (request, check of the plan), the rule applying
APPLIES: list[tuple[str, PlanRequest, Callable[[Plan], bool]]] = [
    ("recipe-low-latency", R(recipe="low-latency"),
     lambda p: "--tp 8" in flags(p) and "--speculative-num-steps 5 --speculative-eagle-topk 1 "
     "--speculative-num-draft-tokens 6" in flags(p) and "--enable-dp-attention" not in flags(p)),
    ("recipe-balanced", R(recipe="balanced"),
     lambda p: "--dp 8 --ep 8 --enable-dp-attention --moe-a2a-backend deepep" in flags(p)
     and "--speculative-num-steps 1 --speculative-eagle-topk 1 --speculative-num-draft-tokens 2"
     in flags(p)),
    ("recipe-high-throughput", R(recipe="high-throughput"),
     lambda p: "--moe-a2a-backend deepep" in flags(p) and "--speculative" not in flags(p)
     and "--chunked-prefill-size" not in flags(p)),
    ("balanced-long-prefill", R(recipe="balanced", input_len=8192),
     lambda p: serve_args(p).chunked_prefill_size == 32768),
    ("cpu-tp-only", R(hardware="CPU", model="__tiny__", input_len=64, output_len=32),
     lambda p: serve_args(p).device == "cpu" and serve_args(p).tp_size == 1
     and serve_args(p).speculative_algorithm is None),
    ("bf16-plain-tp", R(model="GLM-5.3-BF16", hardware="B300", recipe="balanced"),
     lambda p: not serve_args(p).enable_dp_attention and serve_args(p).tp_size == 8),
    ("nvfp4-no-deepep", R(model="GLM-5.3-NVFP4", hardware="GB300", recipe="balanced"),
     lambda p: serve_args(p).enable_dp_attention and serve_args(p).moe_a2a_backend is None),
    ("amd-rocm", R(hardware="MI355X"),
     lambda p: (a := serve_args(p)).dsa_prefill_backend == a.dsa_decode_backend == "tilelang"
     and a.chunked_prefill_size == 131072 and a.watchdog_timeout == 1200 and a.tp_size == 8),
    ("amd-no-mtp", R(hardware="MI325X", recipe="low-latency"),
     lambda p: serve_args(p).speculative_algorithm is None),
    ("mtp-needs-nextn", R(hardware="GB300", model="__tiny_no_mtp__", input_len=64),
     lambda p: serve_args(p).speculative_algorithm is None),
    ("speculative", R(recipe="high-throughput", speculative="mtp"),
     lambda p: serve_args(p).speculative_num_draft_tokens == 2),
    ("kv-dtype-auto", R(hardware="B200"),
     lambda p: p.layout.kv_dtype == "fp8_e4m3" and "--kv-cache-dtype" not in flags(p)),
    ("hopper-fp8-kv", R(hardware="H200", kv_cache_dtype="fp8_e4m3"),
     lambda p: "--kv-cache-dtype fp8_e4m3 --dsa-prefill-backend flashmla_sparse_q8 "
     "--dsa-decode-backend flashmla_kv" in flags(p)),
    ("cp-interleave", R(hardware="H200", recipe="balanced", context_parallel="interleave"),
     lambda p: (a := serve_args(p)).enable_prefill_cp and a.cp_strategy == "interleave"
     and a.dp_size == 1 and a.attn_cp_size == 8 and not a.enable_dp_attention),
    ("pd-disaggregation", R(pd="decode", pd_transfer_backend="nixl"),
     lambda p: serve_args(p).disaggregation_mode == "decode"
     and serve_args(p).disaggregation_transfer_backend == "nixl"
     and serve_args(p).disaggregation_bootstrap_port == 8998
     and p.commands[-1].dsaserve.startswith(
         "python -m sglang_router.launch_router --pd-disaggregation --prefill ")),
    ("hicache", R(hicache=True, hicache_write_policy="write_back"),
     lambda p: serve_args(p).enable_hierarchical_cache and serve_args(p).hicache_ratio == 2
     and serve_args(p).hicache_write_policy == "write_back"
     and "--hicache-storage-backend" not in flags(p)),
    ("hicache", R(hicache=True, hicache_storage="file"),
     lambda p: "--hicache-write-policy write_through --hicache-storage-backend file"
     in flags(p)),
    ("dp-attention-choice", R(recipe="low-latency", dp_attention="on"),
     lambda p: serve_args(p).enable_dp_attention and serve_args(p).dp_size == 8
     and serve_args(p).speculative_num_steps == 5),
    ("dp-attention-choice", R(recipe="balanced", dp_attention="off"),
     lambda p: not serve_args(p).enable_dp_attention and serve_args(p).tp_size == 8
     and serve_args(p).moe_a2a_backend is None),
    ("balanced-max-running", R(recipe="balanced", input_len=4096, output_len=1024),
     lambda p: serve_args(p).max_running_requests == p.memory.concurrency
     == p.memory.kv_ranks * (p.memory.tokens_per_rank // 5120)),
    ("mem-fraction", R(hardware="H200"), lambda p: serve_args(p).mem_fraction_static == 0.8),
    ("weights-fit", R(), lambda p: p.memory.weights_fit),
    ("kv-fits", R(), lambda p: p.memory.tokens_per_rank >= 9216),
]  # fmt: skip

# rule name -> a request it refuses
REFUSES: list[tuple[str, PlanRequest]] = [
    ("nvfp4-blackwell-only", R(model="GLM-5.3-NVFP4", hardware="H200")),
    ("amd-single-node", R(hardware="MI355X", nodes=2)),
    ("cpu-tp-only", R(hardware="CPU", model="__tiny__", recipe="balanced", input_len=64)),
    ("bf16-plain-tp", R(model="GLM-5.3-BF16", hardware="B300", dp_attention="on")),
    ("amd-rocm", R(hardware="MI355X", dp_attention="on")),
    ("cp-interleave", R(context_parallel="interleave", dp_attention="on")),
    ("cp-no-zigzag", R(context_parallel="zigzag")),
    ("cp-not-on-decode", R(context_parallel="interleave", pd="decode")),
    ("cp-hopper-only", R(hardware="B200", context_parallel="interleave")),
    ("cp-kv-unquantised", R(context_parallel="interleave", kv_cache_dtype="fp8_e4m3")),
    ("cp-single-node", R(model="GLM-5.3-BF16", hardware="H200", nodes=2,
                         context_parallel="interleave")),
    ("amd-no-mtp", R(hardware="MI300X", speculative="mtp")),
    ("mtp-needs-nextn", R(hardware="CPU", model="__tiny_no_mtp__", speculative="mtp",
                          input_len=64, output_len=32)),
    ("dflash2-no-dp-attention", R(recipe="balanced", speculative="dflash2")),
    ("dflash2-no-pd-hicache", R(recipe="low-latency", speculative="dflash2", pd="decode")),
    ("fp8-kv-nvidia-only", R(hardware="MI355X", kv_cache_dtype="fp8_e4m3")),
    ("layout-divides", R(hardware="CPU", model="__tiny__", nodes=3, input_len=64)),
    ("context-fits", R(input_len=200_000, output_len=8192)),
    ("weights-fit", R(model="GLM-5.3-BF16", hardware="H200", nodes=1)),
    ("kv-fits", R(hardware="H200", nodes=1, mem_fraction_static=0.65, input_len=100_000)),
]  # fmt: skip


@pytest.fixture
def resolve(tiny_checkpoint, tiny_checkpoint_no_mtp):
    names = {"__tiny__": tiny_checkpoint, "__tiny_no_mtp__": tiny_checkpoint_no_mtp}
    return lambda request: request.replace(model=names.get(request.model, request.model))


@pytest.mark.parametrize("name, request_, check", APPLIES, ids=[c[0] for c in APPLIES])
def test_rule_applies(name, request_, check, resolve):
    p = plan(resolve(request_))
    assert name in [r.name for r in p.rules], f"{name} not named in the plan"
    assert check(p)


@pytest.mark.parametrize("name, request_", REFUSES, ids=[c[0] for c in REFUSES])
def test_rule_refuses(name, request_, resolve):
    with pytest.raises(Refusal) as e:
        plan(resolve(request_))
    assert e.value.rule == name
    assert e.value.reason


def test_every_rule_is_stated_as_a_test():
    tested = {name for name, *_ in APPLIES} | {name for name, _ in REFUSES}
    assert tested == {r.name for r in RULES}


def test_rules_that_do_not_apply_are_not_named():
    names = [r.name for r in plan(R(hardware="H200", recipe="low-latency")).rules]
    for absent in ("amd-rocm", "bf16-plain-tp", "hicache", "pd-disaggregation", "cp-interleave"):
        assert absent not in names


def test_kv_auto_per_architecture():
    dtypes = {hw: plan(R(hardware=hw)).layout.kv_dtype for hw in ("H200", "B300", "MI355X")}
    assert dtypes == {"H200": "bf16", "B300": "fp8_e4m3", "MI355X": "bf16"}


def test_explicit_bf16_kv_on_blackwell_is_printed():
    p = plan(R(hardware="B200", kv_cache_dtype="bf16"))
    assert serve_args(p).kv_cache_dtype == "bf16"
    assert p.memory.kv_bytes_per_token == 100_152


def test_mem_fraction_gb300_is_higher_than_h200():
    h200 = plan(R(hardware="H200")).layout.mem_fraction
    gb300 = plan(R(hardware="GB300")).layout.mem_fraction
    assert h200 == 0.8 and gb300 > h200


def test_mem_fraction_override():
    assert serve_args(plan(R(mem_fraction_static=0.7))).mem_fraction_static == 0.7


def test_balanced_short_inputs_keep_default_chunking():
    p = plan(R(recipe="balanced", input_len=2048))
    assert "balanced-long-prefill" not in [r.name for r in p.rules]
    assert serve_args(p).chunked_prefill_size is None


def test_amd_balanced_long_input_keeps_32768():
    assert serve_args(plan(R(hardware="MI355X", recipe="balanced"))).chunked_prefill_size == 32768


def test_dflash2_without_dp_attention_is_planned():
    """SGLang's spelling (DFLASH) with the guide's drafter; the block size is the drafter's, so
    no --speculative-num-draft-tokens; both printed lines carry the same flags."""
    p = plan(R(recipe="low-latency", speculative="dflash2"))
    args = serve_args(p)
    assert args.speculative_algorithm == "DFLASH"
    assert args.speculative_draft_model_path == "incoai/GLM-5.3-DFlash2"
    assert args.speculative_num_draft_tokens is None and args.speculative_num_steps is None
    command = p.commands[0]
    assert command.sglang.split()[2:] == command.dsaserve.split()[2:]
    assert (
        "--speculative-algorithm DFLASH --speculative-draft-model-path incoai/GLM-5.3-DFlash2"
        in command.sglang
    )
    own = plan(R(model="GLM-5.3", speculative="dflash2", draft_model="/models/my-dflash"))
    assert serve_args(own).speculative_draft_model_path == "/models/my-dflash"
    with pytest.raises(Refusal, match="no DFlash drafter is known for DeepSeek-V3.2"):
        plan(R(model="DeepSeek-V3.2", speculative="dflash2"))


def test_auto_nodes_names_what_blocks_the_bigger_layout():
    with pytest.raises(Refusal) as e:
        plan(R(model="GLM-5.3-BF16", hardware="MI300X"))
    assert e.value.rule == "weights-fit"
    assert "on 2 nodes: [amd-single-node]" in e.value.reason


def test_multi_node_commands_one_per_node():
    p = plan(R(model="GLM-5.3-BF16", hardware="H200"))
    assert [c.node_rank for c in p.commands] == [0, 1]
    for rank in range(2):
        a = serve_args(p, rank)
        assert (a.nnodes, a.node_rank, a.tp_size) == (2, rank, 16)
        assert a.dist_init_addr == "${NODE0_IP}:5000"


def test_router_role_prints_only_the_router():
    p = plan(R(pd="router", port=31000))
    assert [c.role for c in p.commands] == ["router"]
    router = p.commands[0]
    # no `dsaserve router`: the real sglang-router fronts both stacks, the bootstrap port given
    assert router.dsaserve == router.sglang
    assert router.sglang.startswith("python -m sglang_router.launch_router --pd-disaggregation")
    assert "--prefill http://${PREFILL_HOST}:31000 8998 --decode" in router.dsaserve


@pytest.mark.parametrize(
    "request_, changed",
    [
        (R(model="GLM-5.3-BF16", hardware="H200", nodes=1), {"nodes": 2}),
        (R(model="GLM-5.3-NVFP4", hardware="H200"), {"model": "GLM-5.3"}),
        (R(hardware="MI300X", speculative="mtp"), {"speculative": "auto"}),
        (R(hardware="B200", context_parallel="interleave"), {"context_parallel": None}),
        (R(recipe="balanced", speculative="dflash2"), {"speculative": "auto"}),
        (R(recipe="low-latency", speculative="dflash2", hicache=True), {"speculative": "auto"}),
        (R(model="GLM-5.3-BF16", hardware="MI300X"), {"model": "GLM-5.3"}),
    ],
)
def test_nearest_layout_changes_one_thing(request_, changed):
    near = nearest(request_)
    assert near is not None
    for key, value in changed.items():
        assert getattr(near.request, key) == value
