"""`dsaserve plan` from the command line: text and JSON output, exit codes, checkpoint configs,
and a CPU-runnable case whose printed commands parse with `dsaserve serve`'s parser."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
from test_plan_rules import write_tiny_config

from dsaserve import cli
from dsaserve.args import ServerArgs
from dsaserve.deploy.models import load_model
from dsaserve.plan_cli import main


def serve_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("dsaserve serve ")]


def parse(line: str) -> ServerArgs:
    return ServerArgs.from_cli(shlex.split(line)[2:])


def test_cpu_case_prints_commands_that_parse(tmp_path: Path, capsys):
    folder = write_tiny_config(tmp_path / "tiny model")
    argv = ["plan", "--model", f"{folder}/config.json", "--hardware", "cpu"]
    rc = cli.main(argv + ["--input-len", "64", "--output-len", "32"])
    out = capsys.readouterr().out
    assert rc == 0
    [line] = serve_lines(out)
    args = parse(line)
    assert args.model_path == folder  # the folder, quoted because of the space
    assert (args.device, args.tp_size, args.dp_size) == ("cpu", 1, 1)
    assert args.reasoning_parser == "glm45" and args.tool_call_parser == "glm47"
    assert "sglang serve " + line.removeprefix("dsaserve serve ") in out
    assert "Memory fit:" in out and "cpu-tp-only" in out


def test_cpu_case_json(tmp_path: Path, capsys):
    folder = write_tiny_config(tmp_path / "tiny")
    rc = main(["--model", folder, "--hardware", "CPU", "--input-len", "64", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["ok"] is True
    assert out["layout"]["precision"] == "fp32" and out["layout"]["kv_cache_dtype"] == "fp32"
    # fp32 latent (32) + rope (16) + indexer key (32), 4 B each, over 2 layers
    assert out["memory"]["kv_bytes_per_token"] == 2 * (32 + 16 + 32) * 4
    assert out["memory"]["concurrency"] > 0
    for command in out["commands"]:
        assert parse(command["dsaserve"]).model_path == folder


def test_text_output_names_rules_and_memory(capsys):
    assert main(["--model", "GLM-5.3", "--hardware", "H200", "--recipe", "balanced"]) == 0
    out = capsys.readouterr().out
    for needle in ("recipe-balanced", "balanced-long-prefill", "kv-dtype-auto", "100,152 B"):
        assert needle in out
    [line] = serve_lines(out)
    assert parse(line).enable_dp_attention


def test_multi_node_text_has_one_command_per_node(capsys):
    assert main(["--model", "GLM-5.3-BF16", "--hardware", "GB300"]) == 0
    lines = serve_lines(capsys.readouterr().out)
    assert [parse(line).node_rank for line in lines] == [0, 1]


def test_refusal_exits_1_with_reason_and_nearest(capsys):
    rc = main(["--model", "GLM-5.3-BF16", "--hardware", "H200", "--nodes", "1"])
    err = capsys.readouterr().err
    assert rc == 1
    assert "[weights-fit]" in err and "nearest layout that works" in err
    assert (
        "dsaserve plan --model GLM-5.3-BF16 --hardware H200 --recipe low-latency --nodes 2" in err
    )
    lines = serve_lines(err)
    assert [parse(line).tp_size for line in lines] == [16, 16]


def test_refusal_json(capsys):
    rc = main(["--model", "GLM-5.3-NVFP4", "--hardware", "MI355X", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 1 and out["ok"] is False and out["rule"] == "nvfp4-blackwell-only"
    assert out["nearest"]["layout"]["model"] == "GLM-5.3"
    assert out["nearest"]["plan"].startswith("dsaserve plan --model GLM-5.3 --hardware MI355X")


def test_router_role(capsys):
    assert main(["--pd", "router"]) == 0
    out = capsys.readouterr().out
    assert "python -m sglang_router.launch_router --pd-disaggregation" in out
    assert not serve_lines(out)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--model", "Llama-3"], "not a built-in model"),
        (["--mem-fraction-static", "1.5"], "--mem-fraction-static must be in (0, 1)"),
        (["--input-len", "0"], "--input-len must be >= 1"),
        (["--device-memory-gib", "-1"], "--device-memory-gib must be positive"),
    ],
)
def test_bad_input_exits_2(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_unknown_hardware_is_a_usage_error():
    with pytest.raises(SystemExit) as e:
        main(["--hardware", "TPU"])
    assert e.value.code == 2


def test_config_errors_name_the_problem(tmp_path: Path, capsys):
    write_tiny_config(tmp_path / "llama", model_type="llama")
    assert main(["--model", str(tmp_path / "llama")]) == 2
    assert "not a DSA model" in capsys.readouterr().err
    write_tiny_config(tmp_path / "partial", kv_lora_rank=None)
    assert main(["--model", str(tmp_path / "partial")]) == 2
    assert "lacks kv_lora_rank" in capsys.readouterr().err


def test_checkpoint_precision_is_read_from_the_config(tmp_path: Path):
    fp8 = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
    assert load_model(write_tiny_config(tmp_path / "a", quantization_config=fp8)).precision == "fp8"
    nvfp4 = {"quant_method": "modelopt", "quant_algo": "NVFP4"}
    folder = write_tiny_config(tmp_path / "b", quantization_config=nvfp4)
    assert load_model(folder).precision == "nvfp4"
    assert load_model(write_tiny_config(tmp_path / "c", torch_dtype="bfloat16")).precision == "bf16"


def test_model_path_override_is_printed(capsys):
    assert main(["--model", "GLM-5.3", "--model-path", "/models/glm 5.3"]) == 0
    [line] = serve_lines(capsys.readouterr().out)
    assert parse(line).model_path == "/models/glm 5.3"


DOCS = Path(__file__).resolve().parent.parent / "docs" / "deploy.md"


def doc_examples() -> list[tuple[str, list[str]]]:
    """Each `$ dsaserve plan ...` line of docs/deploy.md with the serve lines shown under it."""
    examples: list[tuple[str, list[str]]] = []
    for line in DOCS.read_text().splitlines():
        if line.startswith("$ dsaserve plan "):
            examples.append((line.removeprefix("$ "), []))
        elif line.startswith("dsaserve serve ") and examples:
            examples[-1][1].append(line)
    return examples


def test_docs_examples_are_what_the_planner_prints(capsys):
    examples = doc_examples()
    assert len(examples) >= 2
    for command, shown in examples:
        main(shlex.split(command)[2:])
        captured = capsys.readouterr()
        assert shown and shown == serve_lines(captured.out + captured.err), command


def test_docs_name_every_rule():
    from dsaserve.deploy.planner import RULES

    text = DOCS.read_text()
    assert [name for name in (r.name for r in RULES) if f"`{name}`" not in text] == []


def test_cpu_fp8_kv_plan_shows_the_smaller_entry(tmp_path: Path, capsys):
    """dsaserve runs an FP8 KV cache on CPU too: the plan takes it, with FlashMLA-layout bytes."""
    folder = write_tiny_config(tmp_path / "tiny")
    argv = ["--model", folder, "--hardware", "CPU", "--input-len", "64", "--json"]
    assert main([*argv, "--kv-cache-dtype", "fp8_e4m3"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] is True and out["layout"]["kv_cache_dtype"] == "fp8_e4m3"
    # e4m3 latent (32) + one fp32 scale + bf16 rope (16), indexer key 32 + 4, over 2 layers
    assert out["memory"]["kv_bytes_per_token"] == 2 * ((32 + 4 + 2 * 16) + (32 + 4))
