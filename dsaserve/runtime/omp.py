"""How long torch's OpenMP threads spin after a parallel region, in every process that runs a model.

torch's CPU build runs its parallel ops on libgomp. Unset, libgomp's threads spin for 300,000
rounds after each parallel region (~15 ms on a 2-core machine of ours) before they sleep. A
prefill's GEMMs end with those threads spinning on the cores that the native decode pool
(kernels/cpu_decode_pool.h) needs for the next decode step; on 2 cores at `--threads 2` a step
after a prefill waited at its barriers and the batch-1 decode of `bench/spec_decode.py` ran
17-29% slower (DFLASH's 8-row verify 4.3-4.9 ms instead of 7.0, docs/benchmarks.md).
`OMP_WAIT_POLICY=PASSIVE` (sleep at once) doubled a short prefill instead (every region then
wakes its threads). 10,000 rounds keep the threads awake between a prefill's back-to-back
regions and let them sleep well before the next decode step.

libgomp reads `GOMP_SPINCOUNT` once, when torch is first imported, so it is set in the
environment before that: by the API process for the engine processes it spawns (and so their
ranks), by `dsaserve.LLM` (for this process when torch is not imported yet, always for its
ranks), and by the benches that run the engine in-process (`bench/spec_decode.py`,
`bench/llamacpp.py`, which starts llama.cpp with the environment it was given, and
`bench/decode_profile.py`). A value already in the environment is kept, and so is
`OMP_WAIT_POLICY` when set (libgomp's own choice then).
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

SPINCOUNT = "10000"


def limit_omp_spinning(env: MutableMapping[str, str] = os.environ) -> None:
    """Set `GOMP_SPINCOUNT` in `env` unless it, or `OMP_WAIT_POLICY`, is set already."""
    if "GOMP_SPINCOUNT" not in env and "OMP_WAIT_POLICY" not in env:
        env["GOMP_SPINCOUNT"] = SPINCOUNT
