"""Block-FP8 checkpoints decode natively with their weights kept FP8 (kernels/cpu_fp8.py,
kernels/cpu_decode_math.h), against the same checkpoint dequantised on load.

- kept: on CPU (`auto`) every quantised Linear but kv_b_proj and every MoE layer's routed experts
  stay e4m3 with their 128x128 scales, and the native layers read those very bytes (the fused
  stacks are the modules' storage; no float copy is made);
- the same answers: greedy tokens and every step's logprobs (and top-2) equal the dequantised
  model's on the layered path (`--fp8-gemm-backend torch --moe-runner-backend torch`, native
  decode off) within 1e-5 (fp32: the FP8 value is made in registers as e4m3 * scale, one
  rounding, as the load-time dequantisation makes it, so the bound is only the GEMMs' sum order),
  for GLM and DeepSeek-V3.2 configs with a context past `index_topk`, one request or six at once,
  and the kept layered path (prefill) too;
- bf16: a bf16 FP8 checkpoint keeps the same FP8 weights and tracks the fp32 dequantised model
  within docs/determinism.md's bf16 bound, no further off than the bf16 dequantised model.
"""

from __future__ import annotations

import pytest
import torch
from engine_score import score
from test_fused_decode import Counted
from test_native_decode import PARAMS, assert_close, errors, prompts_of
from tiny_models import make_checkpoint

from dsaserve import LLM
from dsaserve.engine.decode import native as cpu_decode
from dsaserve.kernels.block_fp8 import FP8_DTYPE
from dsaserve.layers.fp8_experts import Fp8Experts
from dsaserve.layers.fp8_linear import Fp8Linear
from dsaserve.layers.moe import MoE
from dsaserve.models.fp8 import quantize_checkpoint

pytestmark = pytest.mark.skipif(
    cpu_decode.extension() is None, reason="the native decode extension does not build here"
)

# intermediate sizes of whole 128-blocks (the experts are kept only then); kv_a's 48 rows end
# inside a block (the stacked scales then go one row per weight row)
SIZES = dict(moe_intermediate_size=128, intermediate_size=256)
DEQUANTISED = dict(fp8_gemm_backend="torch", moe_runner_backend="torch")
COMMON = dict(page_size=4, max_total_tokens=4096)


@pytest.fixture(scope="module", params=["glm", "deepseek"])
def fp8(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"fp8_{request.param}")
    source = make_checkpoint(root / "src", request.param, seed=3, **SIZES)
    quantize_checkpoint(source, root / "fp8", block=128)
    return root / "fp8"


def kept_llm(folder, **kw) -> tuple[LLM, Counted]:
    llm = LLM(str(folder), **COMMON, **kw)
    step = llm.engine.runner.decode_step
    assert step is not None and step.native is not None
    step.fused.native = counted = Counted(step.native)
    return llm, counted


def test_weights_stay_fp8_and_the_native_layers_read_them_in_place(fp8):
    llm, _ = kept_llm(fp8, dtype="float32")
    model = llm.engine.model
    stats = llm.engine.stats()
    linears = [m for m in model.modules() if isinstance(m, Fp8Linear)]
    layers = model.config.num_hidden_layers
    # q_a, kv_a, q_b, o, the index wk and wq_b, and the MLP's gate, up, down: every layer
    assert stats["fp8_linears_kept"] == len(linears) == 9 * layers
    assert all(m.weight.dtype == FP8_DTYPE for m in linears)
    moes = [m for m in model.model.layers[:layers] if isinstance(m.mlp, MoE)]
    assert moes and all(isinstance(m.mlp.experts, Fp8Experts) for m in moes)
    assert stats["fp8_expert_layers_kept"] == len(moes)
    # the fused stacks the native layers read are the modules' own bytes
    weights = llm.engine.runner.decode_step.fused.weights
    for layer, w in zip(model.model.layers, weights):
        attn = layer.self_attn
        assert w.w_in.dtype == FP8_DTYPE and w.w_idx is not None
        assert attn.q_a_proj.weight.data_ptr() == w.w_in.data_ptr()
        assert attn.q_b_proj.weight.data_ptr() == w.w_qres.data_ptr()
        assert w.scales[1] is not None and w.scales[2] is not None
        assert attn.q_b_proj.weight_scale_inv.data_ptr() == w.scales[1].data_ptr()
        # kv_a (48 rows) ends inside a scale block: w_in's scales one row per weight row
        assert w.scales[0].shape[0] == w.w_in.shape[0]


def test_native_fp8_gives_the_dequantised_models_answers(fp8):
    prompts = prompts_of((30, 9, 50, 3, 70, 41), seed=2)  # most past index_topk
    reference = LLM(str(fp8), dtype="float32", disable_fused_decode=True, **COMMON, **DEQUANTISED)
    want = reference.generate(prompts, PARAMS, use_tqdm=False)
    llm, counted = kept_llm(fp8, dtype="float32")
    together = llm.generate(prompts, PARAMS, use_tqdm=False)
    assert counted.calls > 0
    assert_close(want, together)
    alone = llm.generate(prompts[4:5], PARAMS, use_tqdm=False)
    assert_close(want[4:5], alone)
    # the layered path over the kept weights (a prefill) scores as the dequantised one
    got, expected = score(llm.engine, prompts[4]), score(reference.engine, prompts[4])
    assert (got - expected).abs().max() / expected.abs().max() < 1e-5


def test_bf16_fp8_checkpoint_tracks_its_dequantised_twin(tmp_path):
    source = make_checkpoint(tmp_path / "src", "glm", seed=5, dtype=torch.bfloat16, **SIZES)
    quantize_checkpoint(source, tmp_path / "fp8", block=128)
    prompts = prompts_of((40, 60), seed=4)
    exact = LLM(str(tmp_path / "fp8"), dtype="float32", disable_fused_decode=True, **COMMON,
                **DEQUANTISED).generate(prompts, PARAMS, use_tqdm=False)  # fmt: skip
    twin = LLM(str(tmp_path / "fp8"), dtype="bfloat16", disable_fused_decode=True, **COMMON,
               **DEQUANTISED).generate(prompts, PARAMS, use_tqdm=False)  # fmt: skip
    llm, counted = kept_llm(tmp_path / "fp8", dtype="bfloat16")
    got = llm.generate(prompts, PARAMS, use_tqdm=False)
    assert counted.calls > 0
    assert all(m.weight.dtype == FP8_DTYPE for m in llm.engine.model.modules()
               if isinstance(m, Fp8Linear))  # fmt: skip
    # bf16: the native step computes in fp32 over the same FP8 values (no bf16 weight rounding):
    # within docs/determinism.md's bf16 bound of the fp32 answers up to the first differing
    # token, and on average no further off than the bf16 twin (as the bf16 native test)
    ours, theirs = errors(exact, got), errors(exact, twin)
    assert max(ours) < 0.1
    assert sum(ours) / len(ours) <= 2 * sum(theirs) / len(theirs) + 0.002
