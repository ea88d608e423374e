"""bench/llamacpp.py's pure-Python parts: arguments, the result table, and the converter layout.

The full benchmark (building llama.cpp, both engines timed) does not run in CI; these check that
the checkpoint it hands llama.cpp's converter holds exactly the model's weights in the
per-expert layout, and that the summary and table report what the runs measured.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tiny_models import make_checkpoint

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))
import llamacpp  # noqa: E402
import llamacpp_setup as setup  # noqa: E402

from dsaserve.assets import default_model_path  # noqa: E402


def test_arguments_parse_and_refuse_bad_lists():
    args = llamacpp.parse_args(["--threads", "1,2", "--contexts", "512,4096"])
    assert args.threads == [1, 2] and args.contexts == [512, 4096]
    with pytest.raises(SystemExit):
        llamacpp.parse_args(["--threads", "one"])
    with pytest.raises(SystemExit):
        llamacpp.parse_args(["--contexts", "0"])


def test_converter_layout_splits_fused_experts(tmp_path):
    folder = default_model_path()  # saved with fused experts, as the benchmark converts it
    fused = {}
    for file in folder.glob("*.safetensors"):
        fused.update(load_file(file))
    out = load_file(setup.write_converter_layout(folder, tmp_path / "layout") / "model.safetensors")
    gate_ups = [n for n in fused if n.endswith("mlp.experts.gate_up_proj")]
    assert gate_ups, "the tiny checkpoint has fused experts"
    for name in gate_ups:
        prefix = name[: -len("gate_up_proj")]
        gate_up, down = fused[name], fused[prefix + "down_proj"]
        inter = gate_up.shape[1] // 2
        for e in range(gate_up.shape[0]):
            assert torch.equal(out[f"{prefix}{e}.gate_proj.weight"], gate_up[e, :inter])
            assert torch.equal(out[f"{prefix}{e}.up_proj.weight"], gate_up[e, inter:])
            assert torch.equal(out[f"{prefix}{e}.down_proj.weight"], down[e])
    kept = {n for n in fused if ".mlp.experts." not in n}
    assert all(torch.equal(out[n], fused[n]) for n in kept)
    assert not any(n.endswith(("gate_up_proj", "experts.down_proj")) for n in out)
    assert (tmp_path / "layout" / "config.json").is_file()
    assert (tmp_path / "layout" / "tokenizer.json").is_file()


def test_converter_layout_keeps_a_per_expert_checkpoint(tmp_path):
    """transformers 5.24's save_pretrained already writes per-expert tensors: kept as they are."""
    folder = make_checkpoint(tmp_path / "ckpt", "glm", 0)
    before = load_file(next(folder.glob("*.safetensors")))
    after = load_file(setup.write_converter_layout(folder, tmp_path / "out") / "model.safetensors")
    assert before.keys() == after.keys()
    assert all(torch.equal(before[n], after[n]) for n in before)


def test_converter_shim_is_valid_python_naming_the_pre_tokenizer(tmp_path):
    cmd = setup.converter_command(tmp_path / "src", tmp_path / "layout", tmp_path / "m.gguf")
    shim = cmd[-1]
    ast.parse(shim)
    assert repr(setup.PRE_TOKENIZER) in shim and "--outtype" in shim
    build = setup.cmake_command(tmp_path / "src", tmp_path / "build")
    assert "-DGGML_NATIVE=ON" in build and "-DLLAMA_BUILD_SERVER=ON" in build


def test_summary_takes_medians_and_ratios_and_the_table_lists_every_run():
    runs = [
        {"workload": "decode", "size": 512, "threads": 1, "engine": "llamacpp", "tok_s": 200.0},
        {"workload": "decode", "size": 512, "threads": 1, "engine": "llamacpp", "tok_s": 240.0},
        {"workload": "decode", "size": 512, "threads": 1, "engine": "dsaserve", "tok_s": 110.0},
        {"workload": "chats", "size": 32, "threads": 2, "engine": "dsaserve", "tok_s": 600.0},
        {"workload": "chats", "size": 32, "threads": 2, "engine": "llamacpp", "tok_s": 400.0},
    ]
    rows = llamacpp.summarise(runs)
    assert [(r["workload"], r["threads"]) for r in rows] == [("decode", 1), ("chats", 2)]
    assert rows[0]["llamacpp"] == 220.0 and rows[0]["ratio"] == pytest.approx(0.5)
    assert rows[1]["ratio"] == pytest.approx(1.5)
    text = llamacpp.table(rows, {1: 515.0})
    assert "**0.50×**" in text and "**1.50×**" in text
    assert "200, 240 / 110" in text and "llama-bench" in text


def test_random_prompts_differ_per_seed_and_avoid_special_ids():
    a, b = llamacpp.random_prompt(64, 1319, 1), llamacpp.random_prompt(64, 1319, 2)
    assert a != b and min(a + b) >= 32 and max(a + b) < 1319


def test_the_exactness_check_compares_llamacpp_up_to_the_first_end_token():
    """llama-server bans end tokens under ignore_eos, so its tokens are compared with the
    reference's up to the first end token (where it must have stopped)."""
    assert llamacpp.until_eog([5, 6, 7, 8, 7], {7, 9}) == [5, 6]
    assert llamacpp.until_eog([5, 6], {7}) == [5, 6]
    assert llamacpp.until_eog([9, 5], {7, 9}) == []
