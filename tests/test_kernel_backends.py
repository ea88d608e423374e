"""The backend seam: flags, choice per device, and the engine running the Triton kernels.

On CPU the Triton kernels run under the interpreter (tests/triton_env.py), so a whole decode
through `--dsa-decode-backend triton` checks the kernels inside the model, not just alone.
"""

from __future__ import annotations

import pytest
import torch
from tiny_models import make_checkpoint
from triton_env import needs_triton

from dsaserve import LLM, SamplingParams
from dsaserve.args import ArgsError, ServerArgs, refuse_unrunnable
from dsaserve.kernels.registry import IMPLEMENTATIONS, choose_kernels, load

PROMPT = torch.randint(0, 380, (40,), generator=torch.Generator().manual_seed(5)).tolist()


def test_cpu_chooses_the_torch_reference_for_every_op() -> None:
    kernels = choose_kernels(ServerArgs(), "cpu")
    assert set(kernels.names) == set(IMPLEMENTATIONS)
    assert set(kernels.names.values()) == {"torch"}
    for op in IMPLEMENTATIONS:
        assert load(op, "torch") is not None  # imports


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--dsa-decode-backend", "flashmla_kv"], "--dsa-decode-backend flashmla_kv: a CUDA"),
        (["--dsa-prefill-backend", "fa3"], "--dsa-prefill-backend fa3: a CUDA kernel"),
        (["--fp8-gemm-backend", "deep_gemm"], "--fp8-gemm-backend deep_gemm: a CUDA kernel"),
        (["--moe-runner-backend", "triton"], "--moe-runner-backend triton: a CUDA kernel"),
    ],
)
def test_cuda_only_backends_are_refused_on_cpu_in_one_line(argv, message) -> None:
    with pytest.raises(ArgsError) as err:
        refuse_unrunnable(ServerArgs.from_cli(argv), "cpu")
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_unknown_backend_names_are_rejected() -> None:
    with pytest.raises(ArgsError, match="--fp8-gemm-backend nope: choose one of"):
        ServerArgs(fp8_gemm_backend="nope")
    with pytest.raises(SystemExit):
        ServerArgs.from_cli(["--moe-runner-backend", "nope"])


@needs_triton
@pytest.mark.parametrize("kv", ["auto", "fp8_e4m3"])
def test_engine_decodes_the_same_tokens_with_the_triton_kernels(tmp_path, kv: str) -> None:
    folder = make_checkpoint(tmp_path / "m", "glm", seed=11)  # index_topk 8: sparse decode
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=0)
    outs = {}
    for backend in ("torch", "triton"):
        llm = LLM(str(folder), dtype="float32", max_total_tokens=256, page_size=4,
                  kv_cache_dtype=kv, dsa_decode_backend=backend)  # fmt: skip
        assert llm.engine.kernels.names["sparse_mla"] == backend
        assert llm.engine.kernels.names["indexer"] == backend
        outs[backend] = llm.generate([PROMPT], params, use_tqdm=False)[0]
    assert outs["triton"].token_ids == outs["torch"].token_ids
    for a, b in zip(outs["torch"].logprobs, outs["triton"].logprobs):
        assert abs(a.logprob - b.logprob) < 1e-4
