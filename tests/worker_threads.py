"""Under pytest-xdist (pyproject's `-n 2`), each worker runs torch, and every engine it builds, on
one thread: OMP_NUM_THREADS=1 before torch is imported (engine/startup.py `default_threads` reads it
too, so an in-process engine does not take both cores back). Two workers with two spinning OpenMP
threads each on two cores ran some in-process tests 10-17x slower. conftest.py imports it before
anything imports torch.
"""

import os

if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch

    torch.set_num_threads(1)  # in case a plugin imported torch first
