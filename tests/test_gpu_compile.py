"""The compile check, on CPU: every Triton launch our launch code makes at the shapes we claim
(bench/gpu_check_launches.py: GLM-5.3 and DeepSeek-V3.2 at TP1 / TP2 / TP4 / TP8 / EP8, GLM-5.3's
BF16 checkpoint, the embedded model; bf16, FP8 and fp32 KV caches; every CUDA-graph bucket)
compiled ahead of time for sm_90 and sm_100 with Triton's bundled ptxas
(bench/gpu_check_compile.py). Each compiles, spills nothing, fits the target's shared memory,
and issues the matrix instruction its tile allows (bench/gpu_check_report.py:
`expected_family`; 16-bit / FP8 dots on FMAs fail). The configurations are recorded from the
launch code, not listed here, so a new tile choice or a new kernel is checked without editing
this file."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from triton_env import needs_triton

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from gpu_check_report import TENSOR_CORES, expected_family, problems  # noqa: E402

TARGETS = (90, 100)
ATTENTION = ("_indexer_scores_kernel", "_sparse_mla_kernel")  # the long-context hot ops


def launched_kernels() -> set[str]:
    """Every `_..._kernel` @triton.jit function in dsaserve/kernels/triton_*.py."""
    found = set()
    for path in (ROOT / "dsaserve/kernels").glob("triton_*.py"):
        found |= set(re.findall(r"@triton\.jit[^\n]*\ndef (_\w+_kernel)\(", path.read_text()))
    return found


@needs_triton
def test_every_launch_compiles_clean_for_sm90_and_sm100(tmp_path) -> None:
    out = tmp_path / "compile.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    done = subprocess.run([sys.executable, str(ROOT / "bench/gpu_check_compile.py"), "--targets",
                           *map(str, TARGETS), "--out", str(out)],
                          env=env, capture_output=True, text=True, timeout=580)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    print(done.stdout)
    results = json.loads(out.read_text())["results"]
    for cc in TARGETS:
        assert {r["kernel"] for r in results if r["target"] == cc} == launched_kernels()
    # the script's verdict (exit 1 on any FAIL), checked again here from its results
    assert not [p for r in results for p in problems(r)]
    assert all(r["expected"] == expected_family(r) for r in results)
    # every indexer and sparse-MLA configuration with 16-bit dots (all of GLM-5.3's and
    # DeepSeek-V3.2's: a bf16 query over a bf16, FP8 or fp32 cache) on tensor cores, and at M
    # >= 64 (the indexer's 64-key blocks, 64-head attention) on warp-group MMA
    attention = [r for r in results if r["kernel"] in ATTENTION]
    mma = [r for r in attention if r["constexprs"]["DOT"] != "fp32"]
    assert {r["family"] for r in mma} <= set(TENSOR_CORES)
    assert {(r["target"], r["family"]) for r in mma if r["kernel"] == ATTENTION[0]} == {
        (90, "wgmma"), (100, "tcgen05")}  # fmt: skip
    ieee = [r["labels"] for r in attention if r["constexprs"]["DOT"] == "fp32"]
    assert all(label.startswith("embedded") for labels in ieee for label in labels), ieee


def test_the_planner_says_which_gpus_are_checked() -> None:
    """The hardware list claims "checked in CI" for exactly the targets compiled above; GPUs
    below sm_80 and AMD's are refused (kernels/gpu_target.py)."""
    from dsaserve.deploy.hardware import HARDWARE, TRITON_SUPPORT

    checked = {cc for cc, line in TRITON_SUPPORT.items() if "checked in CI" in line}
    assert checked == set(TARGETS)
    assert {hw.sm for hw in HARDWARE.values() if hw.sm in checked} == set(TARGETS)
    assert all("refused" in HARDWARE[name].triton_kernels for name in ("MI300X", "MI355X"))
    assert "refused" in TRITON_SUPPORT["older"]
