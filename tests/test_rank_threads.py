"""SGLANG_CPU_OMP_THREADS_BIND, read as SGLang writes it: one core range per rank of the node
(runtime/ranks.py `bound_cores`; the binding itself is checked on real ranks in
tests/test_parallel_serve.py's offline LLM test)."""

from __future__ import annotations

import pytest

from dsaserve.runtime.ranks import bound_cores


@pytest.mark.parametrize("spec, rank, cores", [
    ("", 0, []), ("0-3|4-7", 1, [4, 5, 6, 7]), ("0,2,4-5|1", 0, [0, 2, 4, 5]),
])  # fmt: skip
def test_bind_ranges_give_each_rank_its_cores(spec, rank, cores):
    assert bound_cores(spec, rank, 2) == cores


@pytest.mark.parametrize("spec, message", [
    ("0-3", "1 core ranges for 2 ranks"), ("0-3|x", "'x' is not a core id"),
])  # fmt: skip
def test_bind_ranges_refused_naming_the_value(spec, message):
    with pytest.raises(ValueError, match=message):
        bound_cores(spec, 1, 2)
