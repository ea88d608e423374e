"""bench/gpu_check.py: its shape tables and bytes floor (CPU-safe), and the whole script at toy
shapes under the Triton interpreter (so the prepared GPU script is not dead code)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from triton_env import gpu, needs_triton

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import gpu_check  # noqa: E402

from dsaserve.deploy.models import BUILTIN_MODELS  # noqa: E402


def test_rank_shapes_tp8_and_ep8() -> None:
    spec = BUILTIN_MODELS["GLM-5.3"]
    tp, ep = gpu_check.rank_shapes(spec, 8, "tp"), gpu_check.rank_shapes(spec, 8, "ep")
    assert tp.heads == ep.heads == 8 and tp.index_topk == 2048 and tp.layers == 78
    assert (tp.experts, tp.expert_inter) == (256, 256)  # all experts, an eighth of each
    assert (ep.experts, ep.expert_inter) == (32, 2048)  # 32 whole experts
    with pytest.raises(ValueError):
        gpu_check.rank_shapes(spec, 8, "dp")


def test_bytes_floor_matches_the_reference_arithmetic() -> None:
    """docs (gpu.md): ~7.5 / 26 / 68 / 95 GB a step at batch 1 / 8 / 32 / 64 and 8k context;
    ~162 experts touched at batch 32; the FP8 KV halves the top-k entry bytes."""
    s = gpu_check.rank_shapes(BUILTIN_MODELS["GLM-5.3"])
    assert round(gpu_check.experts_touched(32)) in range(160, 166)
    for batch, gb in ((1, 7.5), (8, 26), (32, 68), (64, 95)):
        total = gpu_check.floor_bytes(s, batch, 8192)["total"] / 1e9
        assert abs(total - gb) / gb < 0.1, (batch, total)
    assert gpu_check.floor_ms(4.3e12, 4.3e12) == 1000.0
    fp8 = gpu_check.floor_bytes(s, 32, 32768)["kv_and_index_keys"]
    bf16 = gpu_check.floor_bytes(s, 32, 32768, kv_fp8=False)["kv_and_index_keys"]
    assert fp8 < bf16


def test_arguments_and_table() -> None:
    args = gpu_check.parse_args(["--batches", "1", "8", "--tiny"])
    assert args.batches == [1, 8] and args.tiny and args.tp == 8
    with pytest.raises(SystemExit):
        gpu_check.parse_args(["--batches", "0"])
    row = {"batch": 1, "step_ms": 3.0, "floor_ms": 1.5, "floor_bytes": 7.5e9}
    assert "| 1 | 3.00 | 1.50 | 2.00 | 7.5 |" in gpu_check.table([row])


@needs_triton
def test_the_script_runs_end_to_end_at_toy_shapes(tmp_path) -> None:
    out = tmp_path / "check.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, str(ROOT / "bench/gpu_check.py"), "--tiny",
                           "--batches", "1", "--iters", "1", "--out", str(out)],
                          env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(out.read_text())
    assert report["checks"] and all(c["ok"] for c in report["checks"])
    assert report["decode"][0]["batch"] == 1 and report["decode"][0]["floor_ms"] > 0
    assert report["decode"][0]["cuda_graph"] is torch.cuda.is_available()  # the graph runner
    if torch.cuda.device_count() < 2:  # the --tp 2 graph check needs two GPUs, says so
        assert report["ranks"] == {"name": "tp2 CUDA-graph decode equals eager", "ok": None,
                                   "detail": "needs 2 CUDA devices"}  # fmt: skip


@pytest.mark.gpu
@gpu
def test_gpu_kernels_at_rank_shapes() -> None:
    """On a GPU: the kernel checks at GLM-5.3's TP8 shapes (the script's part 1, 8k context)."""
    import gpu_check_run

    spec = BUILTIN_MODELS["GLM-5.3"]
    shapes = {moe: gpu_check.rank_shapes(spec, 8, moe) for moe in ("tp", "ep")}
    checks = gpu_check_run.run_checks(shapes, [8192])
    assert torch.cuda.is_available() and all(c["ok"] for c in checks), checks
