"""runtime/omp.py: `GOMP_SPINCOUNT` is set for the processes that will import torch, unless the
user chose the spin (`GOMP_SPINCOUNT` or `OMP_WAIT_POLICY`) already. That the server's engine
process and its ranks get it: tests/test_rank_surfaces.py."""

from __future__ import annotations

import os
import subprocess
import sys

from dsaserve.runtime.omp import SPINCOUNT, limit_omp_spinning


def test_set_unless_the_user_chose() -> None:
    env: dict[str, str] = {}
    limit_omp_spinning(env)
    assert env == {"GOMP_SPINCOUNT": SPINCOUNT}
    for chosen in ({"GOMP_SPINCOUNT": "123"}, {"OMP_WAIT_POLICY": "ACTIVE"}):
        env = dict(chosen)
        limit_omp_spinning(env)
        assert env == chosen


def test_llm_sets_it_before_torch_loads() -> None:
    """`from dsaserve import LLM` in a fresh interpreter: torch comes in after the variable."""
    code = ("import os, sys; from dsaserve import LLM; assert 'torch' in sys.modules; "
            "print(os.environ['GOMP_SPINCOUNT'])")  # fmt: skip
    env = {k: v for k, v in os.environ.items()
           if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True, timeout=120)  # fmt: skip
    assert out.stdout.strip() == SPINCOUNT
