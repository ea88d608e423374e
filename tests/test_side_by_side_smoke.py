"""bench/side_by_side.py: the FLOP arithmetic, the report logic, and one tiny live run.

The live run starts dsaserve and `transformers serve` on a tiny random checkpoint, checks that both
served every request with the exact output length (ignore_eos on dsaserve, min_new_tokens on the
reference), that the JSON, table and ratios agree, and that both process groups are gone after.
It checks behaviour only, never speed.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))
import flops  # noqa: E402
import sbs_report as report  # noqa: E402
import sbs_servers as servers  # noqa: E402
import side_by_side  # noqa: E402

from dsaserve.assets import default_model_path  # noqa: E402


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("sbs") / "tiny"
    return servers.make_random_checkpoint(
        default_model_path(), folder, **side_by_side.tiny_overrides()
    )


def _by_hand(config: dict) -> int:
    """Matmul weights one token uses, from the config (the embedded architecture's layout)."""
    h, heads, rank, rope = (config[k] for k in ("hidden_size", "num_attention_heads",
                                                "kv_lora_rank", "qk_rope_head_dim"))  # fmt: skip
    q_lora, nope, v = config["q_lora_rank"], config["qk_nope_head_dim"], config["v_head_dim"]
    idx_heads, idx_dim = config["index_n_heads"], config["index_head_dim"]
    attn = (h * q_lora + q_lora * heads * (nope + rope) + h * (rank + rope)
            + rank * heads * (nope + v) + heads * v * h)  # fmt: skip
    indexer = q_lora * idx_heads * idx_dim + h * idx_dim + h * idx_heads
    moe_i, experts = config["moe_intermediate_size"], config["num_experts_per_tok"]
    moe = h * config["n_routed_experts"] + (experts + config["n_shared_experts"]) * 3 * h * moe_i
    dense = 3 * h * config["intermediate_size"]
    layers, first_dense = config["num_hidden_layers"], config["first_k_dense_replace"]
    blocks = layers * (attn + indexer) + first_dense * dense + (layers - first_dense) * moe
    return blocks + config["vocab_size"] * h


def test_active_params_match_the_config(tiny_checkpoint: Path) -> None:
    config = json.loads((tiny_checkpoint / "config.json").read_text())
    count = flops.active_params(tiny_checkpoint)
    assert count.active == _by_hand(config)
    assert count.total > count.active + config["vocab_size"] * config["hidden_size"]
    short = flops.decode_flops_per_token(tiny_checkpoint, 4)
    long = flops.decode_flops_per_token(tiny_checkpoint, 400)
    assert 2 * count.active < short < long


def test_matmul_peak_is_positive_and_restores_threads() -> None:
    import torch

    before = torch.get_num_threads()
    peak = flops.matmul_peak(1, sizes=(128,), reps=2)
    assert peak.best >= peak.median > 0 and peak.threads == 1
    assert torch.get_num_threads() == before


def _level(conc: int, ours: dict, peer: dict) -> dict:
    return {"concurrency": conc, "dsaserve": ours, "transformers": peer,
            "ratios": report.ratios(ours, peer)}  # fmt: skip


def test_targets_and_table() -> None:
    fast = {"output_throughput": 90.0, "median_ttft_ms": 50.0, "median_itl_ms": 9.0}
    slow = {"output_throughput": 10.0, "median_ttft_ms": 100.0, "median_itl_ms": 10.0}
    levels = [_level(1, slow, fast), _level(16, fast, slow), _level(32, fast, slow)]
    result = report.targets(levels)
    assert result["c32_output_throughput"]["met"] is True
    assert result["c32_output_throughput"]["measured"] == pytest.approx(9.0)
    assert result["c16_p50_ttft"]["met"] is True
    assert result["c1_p50_itl"]["met"] is False
    missing = report.targets(levels[:1])
    assert missing["c32_output_throughput"]["met"] is None
    table = report.format_table([*levels, {"concurrency": 4, "dsaserve": {"error": "boom"}}])
    assert "9.00x" in table and "error: boom" in table


@pytest.mark.skipif(not servers.peer_available(), reason="transformers serve is unavailable")
@pytest.mark.timeout(300)
def test_live_side_by_side(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "sbs.json"
    argv = ["--tiny", "--concurrency", "1,2", "--input-len", "16", "--output-len", "5",
            "--min-prompts", "2", "--prompts-per-level", "1", "--threads", "1",
            "--skip-peak", "--json", str(out), "--chart", ""]  # fmt: skip
    result = side_by_side.main(argv)
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    for pid in result["server_pids"].values():
        assert servers.group_members(pid) == []
    assert [lv["concurrency"] for lv in result["levels"]] == [1, 2]
    for level in result["levels"]:
        for name in ("dsaserve", "transformers"):
            record = level[name]
            assert record["completed"] == 2 and record["failed"] == 0, record
            assert record["total_output_tokens"] == 2 * 5  # exact lengths on both
        ours, peer = level["dsaserve"], level["transformers"]
        expected = ours["output_throughput"] / peer["output_throughput"]
        assert level["ratios"]["output_throughput"] == pytest.approx(expected)
    assert result["targets"]["c1_p50_itl"]["measured"] is not None
    printed = capsys.readouterr().out
    assert "ratio d/t" in printed and "Issue 6 targets" in printed
