"""The backend seam: flags, choice per device, and the engine running the Triton kernels.

On CPU the Triton kernels run under the interpreter (tests/triton_env.py), so a whole decode
through `--dsa-decode-backend triton` checks the kernels inside the model, not just alone.
"""

from __future__ import annotations

import pytest
import torch
from engine_score import score
from tiny_models import make_checkpoint
from triton_env import gpu, needs_triton

from dsaserve import LLM, SamplingParams
from dsaserve.args import ArgsError, ServerArgs
from dsaserve.kernels.registry import IMPLEMENTATIONS, choose_kernels, load
from dsaserve.runtime.preflight import refuse_unrunnable

PROMPT = torch.randint(0, 380, (40,), generator=torch.Generator().manual_seed(5)).tolist()


def test_cpu_chooses_the_torch_reference_for_every_op() -> None:
    """...but the two ops over block-FP8 weights, whose CPU backend keeps them FP8."""
    kernels = choose_kernels(ServerArgs(), "cpu")
    assert set(kernels.names) == set(IMPLEMENTATIONS)
    fp8_ops = {"moe", "fp8_gemm"}
    assert {op for op, name in kernels.names.items() if name == "cpu"} == fp8_ops
    assert {kernels.names[op] for op in set(IMPLEMENTATIONS) - fp8_ops} == {"torch"}
    assert kernels.eager
    for op in IMPLEMENTATIONS:
        assert load(op, "torch") is not None  # imports
    explicit = ServerArgs(moe_runner_backend="torch", fp8_gemm_backend="torch")
    assert set(choose_kernels(explicit, "cpu").names.values()) == {"torch"}


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--dsa-decode-backend", "flashmla_kv"], "--dsa-decode-backend flashmla_kv: a CUDA"),
        (["--dsa-prefill-backend", "fa3"], "--dsa-prefill-backend fa3: a CUDA kernel"),
        (["--fp8-gemm-backend", "deep_gemm"], "--fp8-gemm-backend deep_gemm: a CUDA kernel"),
        (["--moe-runner-backend", "deep_gemm"], "--moe-runner-backend deep_gemm: a CUDA kernel"),
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


@needs_triton
def test_fp8_checkpoint_keeps_fp8_weights_with_the_triton_gemm(tmp_path) -> None:
    """`--fp8-gemm-backend triton`: the quantised Linears hold the checkpoint's e4m3 bytes (no
    dequantised copy) and compute through the block-FP8 GEMM; the logits stay those of the
    dequantising torch path up to the activation's e4m3 rounding."""
    from dsaserve.layers.fp8_linear import Fp8Linear
    from dsaserve.models.fp8 import quantize_checkpoint

    fp8 = tmp_path / "fp8"
    src = make_checkpoint(tmp_path / "src", "glm", seed=4, index_topk=64)  # dense: no flips
    quantize_checkpoint(src, fp8, block=128)
    common = dict(dtype="float32", max_total_tokens=256, page_size=4)
    kept = LLM(str(fp8), fp8_gemm_backend="triton", **common).engine
    dequantised = LLM(str(fp8), fp8_gemm_backend="torch", moe_runner_backend="torch",
                      **common).engine  # fmt: skip
    proj = kept.model.model.layers[1].self_attn.o_proj
    assert isinstance(proj, Fp8Linear) and proj.weight.dtype == torch.float8_e4m3fn
    assert kept.stats()["fp8_linears_kept"] > 10 and dequantised.stats()["fp8_linears_kept"] == 0
    assert kept.model_config.quantization == "fp8"
    prompt = PROMPT[:24]
    got, want = score(kept, prompt), score(dequantised, prompt)
    # the activation's per-token 1x128 e4m3 rounding (~3.6% rms a Linear) is the only change
    assert ((got - want).norm() / want.norm()).item() < 0.15
    # and with the GEMM swapped for its exact torch math, the logits are the kernel's
    for module in kept.model.modules():
        if isinstance(module, Fp8Linear):
            module.gemm = _exact_fp8_gemm
    torch.testing.assert_close(score(kept, prompt), got, rtol=1e-4, atol=1e-4)


def _exact_fp8_gemm(x, w8, scale_inv, bias=None):
    from dsaserve.kernels.block_fp8 import dequantize_block_fp8
    from dsaserve.kernels.triton_fp8_gemm import act_quant

    flat = x.reshape(-1, x.shape[-1])
    a8, a_scale = act_quant(flat)
    a = a8.float() * a_scale.repeat_interleave(128, 1)[:, : flat.shape[1]]
    y = (a @ dequantize_block_fp8(w8, scale_inv).T).view(*x.shape[:-1], -1).to(x.dtype)
    return y if bias is None else y + bias


@pytest.mark.gpu
@gpu
def test_cuda_auto_picks_triton_and_decodes_like_the_reference(tmp_path) -> None:
    folder = make_checkpoint(tmp_path / "m", "glm", seed=11)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    outs = {}
    for backend in ("auto", "torch"):
        llm = LLM(str(folder), device="cuda", dtype="float32", max_total_tokens=256,
                  page_size=4, kv_cache_dtype="fp8_e4m3", dsa_decode_backend=backend)  # fmt: skip
        expected = "triton" if backend == "auto" else "torch"
        assert llm.engine.kernels.names["sparse_mla"] == expected
        outs[backend] = llm.generate([PROMPT], params, use_tqdm=False)[0].token_ids
    assert outs["auto"] == outs["torch"]


def test_gpus_older_than_sm80_refuse_triton_in_one_line(monkeypatch) -> None:
    """sm_75 (T4): `triton` is refused at start naming the GPU; `auto` takes the torch kernels.
    sm_80 (A100, FP8 decoded in the kernels) and newer keep Triton."""
    from dsaserve.kernels import gpu_target
    from dsaserve.kernels.registry import BackendError, resolve

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: "Tesla T4")
    with gpu_target.as_target(7, 5):
        assert resolve("sparse_mla", "auto", "cuda", "--dsa-decode-backend") == "torch"
        with pytest.raises(BackendError, match=r"^--moe-runner-backend triton: Tesla T4 \(sm_75\)"):
            resolve("moe", "triton", "cuda", "--moe-runner-backend")
    with gpu_target.as_target(8, 0):
        assert resolve("sparse_mla", "auto", "cuda", "--dsa-decode-backend") == "triton"
