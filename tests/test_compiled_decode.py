"""`--enable-torch-compile`: the compiled decode step against the eager one (fp32, 1e-5).

Compiling with inductor on a CPU takes minutes (C++ codegen), far over this suite's budget on a
2-core machine, so it is a nightly test (tests/skip_policy.py), run with `--nightly`:

    python -m pytest -q --nightly tests/test_compiled_decode.py
"""

from __future__ import annotations

import pytest
import torch
from tiny_models import make_checkpoint

from dsaserve import LLM, SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.nightly]  # compiles for minutes on a CPU


@pytest.mark.timeout(1800)
def test_compiled_decode_step_matches_eager(tmp_path):
    folder = make_checkpoint(tmp_path / "ckpt", "glm", 0, indexer_types=["full", "shared", "full"])
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 380, (n,), generator=generator).tolist() for n in (5, 30)]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=2)
    eager = LLM(str(folder), page_size=4, max_total_tokens=1024)
    compiled = LLM(str(folder), page_size=4, max_total_tokens=1024, enable_torch_compile=True)
    assert compiled.engine.runner.decode_step.compiled
    want = eager.generate(prompts, params, use_tqdm=False)
    got = compiled.generate(prompts, params, use_tqdm=False)
    for a, b in zip(want, got):
        assert a.token_ids == b.token_ids
        assert max(abs(x.logprob - y.logprob) for x, y in zip(a.logprobs, b.logprobs)) < 1e-5
