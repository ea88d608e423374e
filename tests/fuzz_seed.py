"""A random seed for each hypothesis run, printed when it fails.

`run_seeded(test)` runs a `@given` test under one seed: DSASERVE_FUZZ_SEED when set (to replay a
failure); under CI=true a fixed one (CI_SEED), so CI draws the same inputs on every run rather
than a case nobody has fixed yet; elsewhere (every developer's run, and `--nightly`) a fresh
random one, so new inputs keep being explored. A failure carries a note with the seed and the
line that replays it. The seed fixes the inputs, not what a random model answers to them on
another CPU (its float sums depend on the vector width), so no check may count on a particular
answer.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable

from hypothesis import seed as hypothesis_seed

CI_SEED = 20261202


def run_seeded(test: Callable[[], None]) -> None:
    drawn = CI_SEED if os.environ.get("CI") == "true" else random.SystemRandom().randrange(2**32)
    value = int(os.environ.get("DSASERVE_FUZZ_SEED") or drawn)
    try:
        hypothesis_seed(value)(test)()
    except BaseException as e:
        e.add_note(f"hypothesis seed {value}: DSASERVE_FUZZ_SEED={value} replays this run")
        raise
