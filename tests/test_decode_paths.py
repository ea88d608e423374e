"""Which forward runs a step (engine/decode/paths.py): the ordered list of paths chooses what the
if-chain in `ModelRunner.forward` chose before it (kept below as `chain_choice`, as it was
written), over the flags and layouts that change it: native layers, the fused Python path, the
layered model, CUDA graphs (forced on CPU, where the runner replays the padded static step
eagerly), EAGLE speculation, and `--tp 2` ranks (native or not). Each case also names the path
an all-decode step takes, so a path that stops being built fails here too."""

from __future__ import annotations

import pytest
from speculative_models import make_mtp_checkpoint

from dsaserve import LLM
from dsaserve.engine.decode import cuda_graph
from dsaserve.engine.decode.paths import Step
from dsaserve.engine.decode.rows import all_decodes
from dsaserve.engine.messages import GenerateRequest
from dsaserve.engine.ranks.rounds import DistributedModel
from dsaserve.engine.scheduler import ScheduledBatch

BASE = dict(page_size=4, max_total_tokens=1024, dtype="float32")
PROMPTS = ([3, 14, 15, 92, 65], [35, 89, 79], [32, 38, 46, 26, 43, 38])
# flags -> the path of an all-decode step
CASES = {
    "native": ({}, "native"),
    "python": ({"disable_native_decode": True}, "python"),
    "compiled": ({"enable_torch_compile": True}, "compiled"),
    "layered": ({"disable_fused_decode": True}, "layered"),
    "graphs": ({"disable_native_decode": True, "graphs": True}, "cuda_graph"),
    "graphs-native": ({"graphs": True}, "native"),
    "graphs-layered": ({"disable_fused_decode": True, "graphs": True}, "cuda_graph"),
    "eagle": ({"speculative_algorithm": "EAGLE", "speculative_num_steps": 2}, "native"),
    "eagle-graphs": ({"speculative_algorithm": "EAGLE", "speculative_num_steps": 2,
                      "disable_native_decode": True, "graphs": True}, "cuda_graph"),
    "tp2": ({"tp_size": 2}, "native"),
    "tp2-layered": ({"tp_size": 2, "disable_native_decode": True}, "layered"),
}  # fmt: skip


def chain_choice(runner, scheduled: ScheduledBatch, all_rows: bool) -> str:
    """`ModelRunner.forward`'s if-chain before the paths list (its choice, not its work), with
    the rule added since: ranks whose every one built its native layers run all-decode steps
    there."""
    step = runner.decode_step
    if step is not None and step.native is not None and not all_rows and all_decodes(scheduled):
        return "native"
    ranks = isinstance(runner.model, DistributedModel) and runner.model.native
    if ranks and not all_rows and all_decodes(scheduled):
        return "native"
    batch, _ = runner.build(scheduled)
    if runner.graphs is not None and runner.graphs.accepts(batch):
        return "cuda_graph"
    if step is not None and step.accepts(batch):
        return "compiled" if step.compiled else "python"
    return "layered"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return str(make_mtp_checkpoint(tmp_path_factory.mktemp("paths"), "glm", 0))


def _steps(engine) -> dict[str, ScheduledBatch]:
    """An all-decode step (scheduled after the prompts ran, not run) and a prefill-shaped one
    over the same requests' prompts (their slots are allocated; it is only chosen for)."""
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(GenerateRequest(rid=f"r{i}", input_ids=list(prompt),
                                           sampling={"max_tokens": 8, "temperature": 0,
                                                     "ignore_eos": True}))  # fmt: skip
    while any(not req.output_ids for req in engine.reqs.values()):
        engine.step()
    decode = engine.scheduler.schedule()
    reqs = decode.reqs
    prefill = ScheduledBatch(reqs, [0] * len(reqs), [len(r.prompt_ids) for r in reqs])
    return {"prefill": prefill, "decode": decode}


@pytest.mark.parametrize("case", list(CASES))
def test_the_paths_choose_what_the_chain_chose(case, checkpoint, monkeypatch):
    flags, decode_path = CASES[case]
    flags = dict(flags)
    if flags.pop("graphs", False):
        monkeypatch.setattr(cuda_graph, "GRAPH_DEVICES", ("cuda", "cpu"))
    with LLM(checkpoint, **BASE, **flags) as llm:
        engine = llm.engine
        runner = engine.runner
        steps = _steps(engine)
        assert all_decodes(steps["decode"]) and not all_decodes(steps["prefill"])
        chosen = {}
        for name, scheduled in steps.items():
            for all_rows in (False, True):
                path = runner.path(Step(scheduled, all_rows, runner.build)).name
                assert path == chain_choice(runner, scheduled, all_rows), (name, all_rows)
                chosen[name, all_rows] = path
        assert chosen["decode", False] == decode_path
