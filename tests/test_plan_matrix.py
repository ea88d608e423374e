"""Every hardware x precision x recipe cell of `dsaserve plan`: the layout it picks, or the rule
that refuses it; and every printed `dsaserve serve` line parses with the server's own parser."""

from __future__ import annotations

import shlex

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dsaserve.args import ServerArgs
from dsaserve.deploy.layout import PlanRequest, Refusal
from dsaserve.deploy.planner import nearest, plan

RECIPES = ("low-latency", "balanced", "high-throughput")
LL_FP8 = "1n tp8 mtp5/1/6"
DP8 = "1n tp8 dp8 ep8"
H100_FP8 = ("2n tp16 mtp5/1/6", "2n tp16 dp16 ep16 mtp1/1/2", "2n tp16 dp16 ep16")
AMD = "1n tp8"
NVFP4_ONLY_BLACKWELL = "refused nvfp4-blackwell-only"

# (hardware, model) -> the cell for low-latency, balanced, high-throughput
MATRIX: dict[tuple[str, str], tuple[str, str, str]] = {
    ("H100", "GLM-5.3"): H100_FP8,
    ("H100", "GLM-5.3-BF16"): ("4n tp32 mtp5/1/6", "4n tp32 mtp1/1/2", "4n tp32"),
    ("H100", "GLM-5.3-NVFP4"): (NVFP4_ONLY_BLACKWELL,) * 3,
    ("H100", "DeepSeek-V3.2"): H100_FP8,
    ("H200", "GLM-5.3"): (LL_FP8, DP8 + " mtp1/1/2", DP8),
    ("H200", "GLM-5.3-BF16"): ("2n tp16 mtp5/1/6", "2n tp16 mtp1/1/2", "2n tp16"),
    ("H200", "GLM-5.3-NVFP4"): (NVFP4_ONLY_BLACKWELL,) * 3,
    ("H200", "DeepSeek-V3.2"): (LL_FP8, DP8 + " mtp1/1/2", DP8),
    ("B200", "GLM-5.3"): (LL_FP8, DP8 + " mtp1/1/2", DP8),
    ("B200", "GLM-5.3-BF16"): ("2n tp16 mtp5/1/6", "2n tp16 mtp1/1/2", "2n tp16"),
    ("B200", "GLM-5.3-NVFP4"): (LL_FP8, "1n tp8 dp8 mtp1/1/2", "1n tp8 dp8"),
    ("B200", "DeepSeek-V3.2"): (LL_FP8, DP8 + " mtp1/1/2", DP8),
    ("B300", "GLM-5.3"): (LL_FP8, DP8 + " mtp1/1/2", DP8),
    ("B300", "GLM-5.3-BF16"): (LL_FP8, "1n tp8 mtp1/1/2", "1n tp8"),
    ("B300", "GLM-5.3-NVFP4"): (LL_FP8, "1n tp8 dp8 mtp1/1/2", "1n tp8 dp8"),
    ("B300", "DeepSeek-V3.2"): (LL_FP8, DP8 + " mtp1/1/2", DP8),
    ("GB300", "GLM-5.3"): ("1n tp4 mtp5/1/6", "1n tp4 dp4 ep4 mtp1/1/2", "1n tp4 dp4 ep4"),
    ("GB300", "GLM-5.3-BF16"): ("2n tp8 mtp5/1/6", "2n tp8 mtp1/1/2", "2n tp8"),
    ("GB300", "GLM-5.3-NVFP4"): ("1n tp4 mtp5/1/6", "1n tp4 dp4 mtp1/1/2", "1n tp4 dp4"),
    ("GB300", "DeepSeek-V3.2"): ("1n tp4 mtp5/1/6", "1n tp4 dp4 ep4 mtp1/1/2", "1n tp4 dp4 ep4"),
    ("MI300X", "GLM-5.3"): (AMD,) * 3,
    ("MI300X", "GLM-5.3-BF16"): ("refused weights-fit",) * 3,
    ("MI300X", "GLM-5.3-NVFP4"): (NVFP4_ONLY_BLACKWELL,) * 3,
    ("MI300X", "DeepSeek-V3.2"): (AMD,) * 3,
    ("MI325X", "GLM-5.3"): (AMD,) * 3,
    ("MI325X", "GLM-5.3-BF16"): (AMD,) * 3,
    ("MI325X", "GLM-5.3-NVFP4"): (NVFP4_ONLY_BLACKWELL,) * 3,
    ("MI325X", "DeepSeek-V3.2"): (AMD,) * 3,
    ("MI355X", "GLM-5.3"): (AMD,) * 3,
    ("MI355X", "GLM-5.3-BF16"): (AMD,) * 3,
    ("MI355X", "GLM-5.3-NVFP4"): (NVFP4_ONLY_BLACKWELL,) * 3,
    ("MI355X", "DeepSeek-V3.2"): (AMD,) * 3,
}
CELLS = [
    (hw, model, recipe, expected)
    for (hw, model), row in MATRIX.items()
    for recipe, expected in zip(RECIPES, row)
]


def describe(request: PlanRequest) -> str:
    """A cell in the table's notation: nodes, tp, dp (DP attention), ep, MTP steps."""
    try:
        lay = plan(request).layout
    except Refusal as refusal:
        return f"refused {refusal.rule}"
    parts = [f"{lay.nodes}n", f"tp{lay.tp}"]
    parts += [f"dp{lay.dp}"] if lay.dp_attention else []
    parts += [f"ep{lay.ep}"] if lay.ep > 1 else []
    if lay.speculative:
        s = lay.speculative
        parts.append(f"mtp{s.num_steps}/{s.eagle_topk}/{s.num_draft_tokens}")
    return " ".join(parts)


def parse_serve(command: str) -> ServerArgs:
    argv = shlex.split(command)
    assert argv[:2] == ["dsaserve", "serve"]
    return ServerArgs.from_cli(argv[2:])


@pytest.mark.parametrize("hw, model, recipe, expected", CELLS)
def test_cell(hw, model, recipe, expected):
    assert describe(PlanRequest(model=model, hardware=hw, recipe=recipe)) == expected


def test_matrix_covers_every_hardware_and_model():
    from dsaserve.deploy.hardware import HARDWARE
    from dsaserve.deploy.models import BUILTIN_MODELS

    gpus = [name for name, hw in HARDWARE.items() if not hw.is_cpu]
    assert set(MATRIX) == {(hw, m) for hw in gpus for m in BUILTIN_MODELS}


@pytest.mark.parametrize("hw, model, recipe, expected", CELLS)
def test_cell_commands_parse_or_nearest_does(hw, model, recipe, expected):
    request = PlanRequest(model=model, hardware=hw, recipe=recipe)
    try:
        p = plan(request)
    except Refusal:
        p = nearest(request)
        assert p is not None, "a refused cell must offer a layout that works"
    for command in p.commands:
        args = parse_serve(command.dsaserve)
        assert command.sglang.split()[2:] == command.dsaserve.split()[2:]
        lay = p.layout
        assert (args.tp_size, args.dp_size, args.ep_size) == (lay.tp, lay.dp, lay.ep)
        assert args.enable_dp_attention == lay.dp_attention
        assert args.model_path == lay.model.model_path
        if lay.nodes > 1:
            assert (args.nnodes, args.node_rank) == (lay.nodes, command.node_rank)


@pytest.mark.parametrize(
    "model, hw, nodes, refused",
    [
        # the guide: BF16 (~1.5 TB) does not fit one 8xH200, 8xB200 or 4xGB300 node ...
        ("GLM-5.3-BF16", "H200", 1, True),
        ("GLM-5.3-BF16", "B200", 1, True),
        ("GLM-5.3-BF16", "GB300", 1, True),
        # ... it fits 8xB300 at TP8, and 2x8xH200 / 2x8xB200 at TP16 or 2x4xGB300 at TP8
        ("GLM-5.3-BF16", "B300", 1, False),
        ("GLM-5.3-BF16", "H200", 2, False),
        ("GLM-5.3-BF16", "B200", 2, False),
        ("GLM-5.3-BF16", "GB300", 2, False),
        # NVFP4 fits one 4xGB300 node at TP4; FP8 needs two 8xH100 nodes
        ("GLM-5.3-NVFP4", "GB300", 1, False),
        ("GLM-5.3", "H100", 1, True),
        ("GLM-5.3", "H100", 2, False),
    ],
)
def test_guide_fit_statements(model, hw, nodes, refused):
    for recipe in RECIPES:
        request = PlanRequest(model=model, hardware=hw, recipe=recipe, nodes=nodes)
        if refused:
            with pytest.raises(Refusal) as e:
                plan(request)
            assert e.value.rule == "weights-fit"
            assert nearest(request).layout.nodes > nodes
        else:
            assert plan(request).layout.nodes == nodes


def test_guide_tp_of_the_bf16_layouts():
    tps = {
        hw: plan(PlanRequest(model="GLM-5.3-BF16", hardware=hw)).layout.tp
        for hw in ("B300", "H200", "B200", "GB300")
    }
    assert tps == {"B300": 8, "H200": 16, "B200": 16, "GB300": 8}


PARSERS = "--reasoning-parser glm45 --tool-call-parser glm47"
MTP_516 = (
    "--speculative-algorithm EAGLE --speculative-num-steps 5 --speculative-eagle-topk 1 "
    "--speculative-num-draft-tokens 6"
)
MTP_112 = MTP_516.replace("steps 5", "steps 1").replace("tokens 6", "tokens 2")
HOST = "--host 0.0.0.0 --port 30000"
# whole commands of a few cells, as the guide writes them
GOLDEN = {
    ("H200", "GLM-5.3", "low-latency"): (
        f"dsaserve serve --model-path zai-org/GLM-5.3 --tp 8 {PARSERS} {MTP_516} "
        f"--mem-fraction-static 0.8 {HOST}"
    ),
    ("GB300", "GLM-5.3", "balanced"): (
        "dsaserve serve --model-path zai-org/GLM-5.3 --tp 4 --dp 4 --ep 4 --enable-dp-attention "
        f"--moe-a2a-backend deepep {PARSERS} {MTP_112} --chunked-prefill-size 32768 "
        f"--max-running-requests 300 --mem-fraction-static 0.85 {HOST}"
    ),
    ("B300", "GLM-5.3-BF16", "high-throughput"): (
        f"dsaserve serve --model-path zai-org/GLM-5.3-BF16 --tp 8 {PARSERS} "
        f"--mem-fraction-static 0.9 {HOST}"
    ),
    ("MI355X", "GLM-5.3", "low-latency"): (
        f"dsaserve serve --model-path zai-org/GLM-5.3 --tp 8 {PARSERS} --dsa-prefill-backend "
        "tilelang --dsa-decode-backend tilelang --chunked-prefill-size 131072 "
        f"--mem-fraction-static 0.8 --watchdog-timeout 1200 {HOST}"
    ),
}


@pytest.mark.parametrize("hw, model, recipe", list(GOLDEN))
def test_golden_commands(hw, model, recipe):
    [command] = plan(PlanRequest(model=model, hardware=hw, recipe=recipe)).commands
    assert command.dsaserve == GOLDEN[hw, model, recipe]
    assert command.sglang == GOLDEN[hw, model, recipe].replace("dsaserve serve", "sglang serve")


@settings(max_examples=150, deadline=None)
@given(
    hw=st.sampled_from(["H100", "H200", "B200", "B300", "GB300", "MI300X", "MI325X", "MI355X"]),
    model=st.sampled_from(["GLM-5.3", "GLM-5.3-BF16", "GLM-5.3-NVFP4", "DeepSeek-V3.2"]),
    recipe=st.sampled_from(RECIPES),
    nodes=st.sampled_from([None, 1, 2, 4]),
    pd=st.sampled_from([None, "prefill", "decode"]),
    hicache=st.booleans(),
    cp=st.sampled_from([None, "interleave", "zigzag"]),
    speculative=st.sampled_from(["auto", "mtp", "none", "dflash2"]),
    kv=st.sampled_from(["auto", "bf16", "fp8_e4m3"]),
    input_len=st.sampled_from([1024, 8192, 100_000]),
)
def test_any_request_plans_commands_that_parse_or_names_its_refusal(
    hw, model, recipe, nodes, pd, hicache, cp, speculative, kv, input_len
):
    from dsaserve.deploy.planner import RULES

    request = PlanRequest(
        model=model, hardware=hw, recipe=recipe, nodes=nodes, pd=pd, hicache=hicache,
        context_parallel=cp, speculative=speculative, kv_cache_dtype=kv, input_len=input_len,
    )  # fmt: skip
    try:
        p = plan(request)
    except Refusal as refusal:
        assert refusal.rule in {r.name for r in RULES}
        p = nearest(request)
        if p is None:
            return
    serve = [c for c in p.commands if c.role != "router"]
    assert len(serve) == p.layout.nodes
    for command in serve:
        args = parse_serve(command.dsaserve)
        assert args.disaggregation_mode == (p.request.pd or "null")
        assert args.enable_hierarchical_cache == p.request.hicache
    assert p.memory.weights_fit and p.memory.concurrency >= 1
