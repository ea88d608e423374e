"""`python tests/pd_fault_server.py CONTROL [dsaserve serve flags]`: `dsaserve serve` whose engine
processes write through tests/pd_faults.py's hook, its mode read from the file CONTROL
(pd_harness.py's `launch(..., faults=CONTROL)` starts it)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from pd_faults import FaultyEngineFactory

from dsaserve.server.launch import main

if __name__ == "__main__":
    control, *flags = sys.argv[1:]
    # the ranks (`python -m dsaserve.runtime.rank_entry`) unpickle the factory: tests/ on their path
    here = str(Path(__file__).resolve().parent)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")]))
    sys.exit(main(flags, engine_factory=FaultyEngineFactory(control)))
