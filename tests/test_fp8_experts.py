"""Routed experts kept block-FP8 at load (layers/fp8_experts.py) and run by the Triton `moe` op.

On CPU the op runs under the interpreter (`--moe-runner-backend triton`); the torch backend
dequantises (tests/test_native_fp8.py has the CPU backend's kept experts). The twin of every check
is the same FP8 checkpoint served dequantised.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from engine_score import score
from safetensors import safe_open
from tiny_models import make_checkpoint
from triton_env import needs_triton

from dsaserve import LLM, SamplingParams
from dsaserve.engine.decode import cuda_graph
from dsaserve.kernels import triton_moe
from dsaserve.kernels.block_fp8 import FP8_DTYPE, dequantize_block_fp8, e4m3_to_float
from dsaserve.layers.fp8_experts import Fp8Experts, keep_fp8_experts
from dsaserve.layers.moe import Experts, MoE
from dsaserve.model_config import ModelConfig
from dsaserve.models.dsa_moe import DsaMoeForCausalLM
from dsaserve.models.fp8 import quantize_checkpoint
from dsaserve.models.loader import CheckpointError, load_checkpoint

pytestmark = needs_triton

E, H, I = 8, 64, 128  # noqa: E741  (experts, hidden, expert intermediate: one scale block)
MOE_LAYERS = 2  # 3 layers, the first dense
PROMPT = torch.randint(0, 380, (80,), generator=torch.Generator().manual_seed(7)).tolist()
COMMON = dict(dtype="float32", max_total_tokens=512, page_size=4)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8_experts")
    # index_topk 128 > the prompt: dense attention, so no top-k selection flips between twins
    src = make_checkpoint(root / "src", "glm", seed=4, moe_intermediate_size=I, index_topk=128)
    quantize_checkpoint(src, root / "fp8", block=128)
    return src, root / "fp8"


def _dq_act(a: torch.Tensor) -> torch.Tensor:
    from dsaserve.kernels.triton_fp8_gemm import act_quant

    a8, scale = act_quant(a)
    return a8.float() * scale.repeat_interleave(128, 1)[:, : a.shape[1]]


def _exact_moe(experts, x, index, weights, layout: str = "auto") -> torch.Tensor:
    """The grouped kernel's math in torch: activations quantised per token and 128 columns
    before each GEMM, the stored weights dequantised, fp32 sums."""
    tokens, top_k = index.shape
    flat = index.reshape(-1)
    gate_up = dequantize_block_fp8(experts.gate_up_proj, experts.gate_up_proj_scale_inv)[flat]
    down = dequantize_block_fp8(experts.down_proj, experts.down_proj_scale_inv)[flat]
    rows = _dq_act(x).repeat_interleave(top_k, 0)[:, None]  # [T*k, 1, H]
    gate, up = torch.bmm(rows, gate_up.transpose(1, 2))[:, 0].chunk(2, dim=-1)
    hidden = _dq_act((F.silu(gate) * up).to(x.dtype))[:, None]
    y = torch.bmm(hidden, down.transpose(1, 2))[:, 0].view(tokens, top_k, -1)
    return (y * weights.float()[..., None]).sum(1).to(x.dtype)


def _layouts(monkeypatch) -> list[str]:
    """Record which layout each Triton MoE call built."""
    built: list[str] = []
    for name in ("masked_layout", "contiguous_layout"):
        original = getattr(triton_moe, name)

        def spy(*args, _original=original, _name=name, **kwargs):
            built.append(_name)
            return _original(*args, **kwargs)

        monkeypatch.setattr(triton_moe, name, spy)
    return built


def test_experts_stay_fp8_and_give_the_dequantised_twins_logits(folders, monkeypatch) -> None:
    _, fp8 = folders
    llm = LLM(str(fp8), moe_runner_backend="triton", **COMMON)
    kept = llm.engine
    twin = LLM(str(fp8), moe_runner_backend="torch", fp8_gemm_backend="torch",
               **COMMON).engine  # the torch backends: dequantised on load  # fmt: skip
    layers = [m for m in kept.model.modules() if isinstance(m, MoE)]
    assert len(layers) == MOE_LAYERS and kept.stats()["fp8_expert_layers_kept"] == MOE_LAYERS
    assert all(isinstance(m.experts, Fp8Experts) for m in layers)
    assert twin.stats()["fp8_expert_layers_kept"] == 0
    assert all(type(m.experts) is Experts and m.experts.down_proj.dtype == torch.float32
               for m in twin.model.modules() if isinstance(m, MoE))  # fmt: skip
    # memory: e4m3 bytes + one fp32 scale per 128x128 block, a quarter of the fp32 twin's
    weights = E * 3 * I * H
    scales = E * (2 * I // 128 + -(-H // 128)) * 4
    assert kept.stats()["routed_expert_bytes"] == MOE_LAYERS * (weights + scales)
    assert twin.stats()["routed_expert_bytes"] == MOE_LAYERS * weights * 4
    # the bytes are the checkpoint's as stored: expert 5's up rows and its scales
    experts = layers[0].experts
    name = "model.layers.1.mlp.experts.5.up_proj.weight"
    with safe_open(str(fp8 / "model.safetensors"), "pt") as f:
        stored, scale = f.get_tensor(name), f.get_tensor(name + "_scale_inv")
    assert stored.dtype == FP8_DTYPE == experts.gate_up_proj.dtype
    assert torch.equal(experts.gate_up_proj[5, I:].view(torch.uint8), stored.view(torch.uint8))
    assert torch.equal(experts.gate_up_proj_scale_inv[5, I // 128 :], scale)

    built = _layouts(monkeypatch)
    got, want = score(kept, PROMPT), score(twin, PROMPT)
    assert built == ["contiguous_layout"] * MOE_LAYERS  # 80 rows: the prefill layout
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=0)
    built.clear()
    out = llm.generate([PROMPT[:20]], params, use_tqdm=False)[0]
    assert built == ["masked_layout"] * MOE_LAYERS * 4  # a 20-row prefill + 3 decode steps
    # Bound: the weights are the same numbers (dequantised = stored * scale), so the one change
    # is the e4m3 rounding of the activations before each expert GEMM (relative error <= 2^-4
    # a value, ~3.6% rms a GEMM, two GEMMs a layer) on the routed experts' share of the residual
    # stream; 0.15 is the bound the FP8 Linear test uses for the same rounding on every Linear.
    assert ((got - want).norm() / want.norm()).item() < 0.15
    # and that difference is the rounding alone: the op swapped for its torch math
    for layer in layers:
        layer.experts.moe = _exact_moe
    exact = score(kept, PROMPT)
    assert ((got - exact).norm() / exact.norm()).item() < 1e-4  # measured 3e-7 (fp32 sum order)
    assert ((exact - want).norm() / want.norm()).item() > 1e-4  # the rounding is real
    # greedy decode through the kernel gives the exact math's tokens
    ref = llm.generate([PROMPT[:20]], params, use_tqdm=False)[0]
    assert out.token_ids == ref.token_ids
    for a, b in zip(out.logprobs, ref.logprobs):
        assert abs(a.logprob - b.logprob) < 1e-3


def test_static_decode_runs_the_fp8_experts(folders, monkeypatch) -> None:
    """The CUDA-graph step (forced on CPU: the static step run eagerly) over FP8 experts gives
    the layered path's tokens and logprobs (the same kernel and layout: 1e-5)."""
    _, fp8 = folders
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, logprobs=2)
    prompts = [PROMPT[:9], PROMPT[9:12]]  # 2 rows
    layered = LLM(str(fp8), moe_runner_backend="triton", disable_cuda_graph=True, **COMMON)
    want = layered.generate(prompts, params, use_tqdm=False)
    monkeypatch.setattr(cuda_graph, "GRAPH_DEVICES", ("cuda", "cpu"))
    llm = LLM(str(fp8), moe_runner_backend="triton", **COMMON)
    assert llm.engine.graphs is not None and llm.engine.stats()["fp8_expert_layers_kept"] == 2
    got = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.stats()["cuda_graph"]["steps"] >= 4
    for a, b in zip(want, got):
        assert a.token_ids == b.token_ids
        assert max(abs(x.logprob - y.logprob) for x, y in zip(a.logprobs, b.logprobs)) < 1e-5


def _meta_model(inter: int) -> DsaMoeForCausalLM:
    raw = dict(model_type="glm_moe_dsa", vocab_size=64, hidden_size=H, intermediate_size=96,
               moe_intermediate_size=inter, num_hidden_layers=3, num_attention_heads=2,
               q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16,
               v_head_dim=16, n_routed_experts=E, num_experts_per_tok=2, n_shared_experts=1,
               first_k_dense_replace=1, index_topk=8, index_n_heads=2,
               index_head_dim=32)  # fmt: skip
    with torch.device("meta"):
        return DsaMoeForCausalLM(ModelConfig._from_dict("meta", raw))


def test_only_whole_block_aligned_experts_are_kept() -> None:
    assert keep_fp8_experts(_meta_model(256), triton_moe.grouped_experts) == MOE_LAYERS
    # I = 32: the gate and up scale blocks would overlap in the fused grid: dequantised
    assert keep_fp8_experts(_meta_model(32), triton_moe.grouped_experts) == 0


def test_an_unquantised_checkpoint_into_fp8_experts_is_refused(folders) -> None:
    src, _ = folders
    with torch.device("meta"):
        model = DsaMoeForCausalLM(ModelConfig.from_hf(str(src), {}))
    keep_fp8_experts(model, triton_moe.grouped_experts)
    with pytest.raises(CheckpointError, match="is not block-FP8"):
        load_checkpoint(model, src, torch.float32, show_progress=False)


def test_e4m3_to_float_is_torchs_conversion_for_every_byte() -> None:
    """The bit-moving conversion the dequantisation uses gives torch's value for each of the 256
    e4m3 bytes but the NaNs (signed zeros and subnormals included)."""
    every = torch.arange(256, dtype=torch.uint8).view(FP8_DTYPE)
    want, got = every.float(), e4m3_to_float(every)
    numbers = ~want.isnan()
    assert int(numbers.sum()) == 254
    assert torch.equal(got[numbers], want[numbers])
    assert torch.equal(got[numbers].signbit(), want[numbers].signbit())
