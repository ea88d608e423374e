"""A random seed for each hypothesis run, printed when it fails.

`run_seeded(test)` runs a `@given` test under one seed: DSASERVE_FUZZ_SEED when set (to replay a
failure), else a fresh random one, so CI explores new inputs on every run instead of one fixed
corpus. A failure carries a note with the seed and the line that replays it.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable

from hypothesis import seed as hypothesis_seed


def run_seeded(test: Callable[[], None]) -> None:
    value = int(os.environ.get("DSASERVE_FUZZ_SEED") or random.SystemRandom().randrange(2**32))
    try:
        hypothesis_seed(value)(test)()
    except BaseException as e:
        e.add_note(f"hypothesis seed {value}: DSASERVE_FUZZ_SEED={value} replays this run")
        raise
