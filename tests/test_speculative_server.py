"""`dsaserve serve --speculative-algorithm EAGLE`: the same greedy text as without speculation,
accept length in /generate meta_info, /get_server_info and /metrics; a checkpoint without an
MTP layer refused at start with the flag to drop."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest
from server_harness import running_server
from speculative_models import make_mtp_checkpoint
from tiny_models import make_checkpoint

from dsaserve import LLM, SamplingParams

PROMPT = [5, 17, 99, 3, 250, 41, 7, 12, 300, 2, 64, 8]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_mtp_checkpoint(tmp_path_factory.mktemp("spec_server") / "ckpt", "glm", seed=3)


def test_server_reports_accept_length(checkpoint):
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    plain = LLM(str(checkpoint), max_total_tokens=4096, page_size=16)
    want = plain.generate([PROMPT], params, use_tqdm=False)[0].token_ids
    flags = ["--speculative-algorithm", "EAGLE", "--speculative-num-steps", "2",
             "--enable-metrics"]  # fmt: skip
    with running_server(checkpoint, *flags) as server:
        body = {
            "input_ids": PROMPT,
            "sampling_params": {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True},
        }
        native = httpx.post(server.url + "/generate", json=body, timeout=120).json()
        assert native["output_ids"] == want
        meta = native["meta_info"]
        assert meta["spec_verify_ct"] > 0
        assert meta["spec_accept_length"] == pytest.approx(12 / meta["spec_verify_ct"])
        proposed = meta["spec_num_proposed_drafts"]
        assert proposed == 2 * meta["spec_verify_ct"]  # two draft tokens per verify step
        assert meta["spec_accept_rate"] == pytest.approx(meta["spec_num_correct_drafts"] / proposed)
        info = httpx.get(server.url + "/get_server_info", timeout=30).json()
        assert info["internal_states"][0]["avg_spec_accept_length"] >= 1.0
        metrics = httpx.get(server.url + "/metrics", timeout=30).text
        line = next(m for m in metrics.splitlines() if m.startswith("sglang:spec_accept_length"))
        assert float(line.rsplit(" ", 1)[1]) >= 1.0
        assert any(m.startswith("sglang:spec_accept_rate") for m in metrics.splitlines())


def test_serve_refuses_checkpoint_without_mtp(tmp_path):
    ckpt = make_checkpoint(tmp_path / "plain", "glm", seed=1)
    command = [sys.executable, "-m", "dsaserve.cli", "serve", "--model-path", str(ckpt),
               "--port", "0", "--max-total-tokens", "512",
               "--speculative-algorithm", "EAGLE"]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "no MTP" in done.stdout + done.stderr
    assert "drop --speculative-algorithm" in done.stdout + done.stderr
