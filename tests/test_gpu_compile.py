"""The compile check, on CPU: every Triton launch our launch code makes at the shapes we claim
(bench/gpu_check_launches.py: GLM-5.3 TP1 / TP8 / EP8 and its BF16 checkpoint, DeepSeek-V3.2,
the embedded model; bf16, FP8 and fp32 KV caches; every CUDA-graph bucket) compiled ahead of time
for sm_90 and sm_100 with Triton's bundled ptxas (bench/gpu_check_compile.py). Each compiles,
spills nothing, fits the target's shared memory, and issues the matrix instruction its tile
allows. The configurations are recorded from the launch code, not listed here, so a new tile
choice or a new kernel is checked without editing this file."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from triton_env import needs_triton

ROOT = Path(__file__).resolve().parents[1]
TARGETS = (90, 100)


def expected_family(result: dict) -> str:
    """The instruction a kernel's tile allows: IEEE fp32 dots are FMAs (the indexer always: its
    selection is the reference's); 16-bit / FP8 dots with M >= 64 (64 heads, a 64-row tile, or
    a swapped one whose M is the weight's 128 rows) are wgmma on sm_90 and tcgen05 on sm_100,
    and mma.sync otherwise (16 heads of sparse MLA)."""
    kernel, constexprs = result["kernel"], result["constexprs"]
    if kernel == "_indexer_scores_kernel":
        return "fma"
    if kernel == "_sparse_mla_kernel":
        if constexprs.get("DOT", "fp32") == "fp32":
            return "fma"
        wide = constexprs["BLOCK_H"] >= 64
    else:
        if constexprs.get("IEEE"):
            return "fma"
        wide = constexprs.get("SWAP") or constexprs["BLOCK_M"] >= 64
    return {90: "wgmma", 100: "tcgen05"}[result["target"]] if wide else "mma"


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
    failed = [f"{r['kernel']} sm_{r['target']} {r['labels'][0]}: {r['error'][:300]}"
              for r in results if not r["ok"]]  # fmt: skip
    assert not failed, failed
    problems = []
    for r in results:
        where = f"{r['kernel']} sm_{r['target']} {r['constexprs']} ({r['labels'][0]})"
        if r["spill_stores"]:
            problems.append(f"{where}: {r['spill_stores']} B of spill stores")
        if r["shared"] > r["shared_limit"]:
            problems.append(f"{where}: {r['shared']} B of shared memory > {r['shared_limit']}")
        if r["family"] != expected_family(r):
            problems.append(f"{where}: {r['family']} ({r['mma']}), not {expected_family(r)}")
    assert not problems, "\n".join(problems)


def test_the_planner_says_which_gpus_are_checked() -> None:
    """The hardware list claims "checked in CI" for exactly the targets compiled above; GPUs
    below sm_80 and AMD's are refused (kernels/gpu_target.py)."""
    from dsaserve.deploy.hardware import HARDWARE, TRITON_SUPPORT

    checked = {cc for cc, line in TRITON_SUPPORT.items() if "checked in CI" in line}
    assert checked == set(TARGETS)
    assert {hw.sm for hw in HARDWARE.values() if hw.sm in checked} == set(TARGETS)
    assert all("refused" in HARDWARE[name].triton_kernels for name in ("MI300X", "MI355X"))
    assert "refused" in TRITON_SUPPORT["older"]
