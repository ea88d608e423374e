"""Block-FP8 weights kept FP8 on every rank under tensor parallelism (models/fp8_keep.py).

A tiny random GLM checkpoint quantised to 128x128 blocks, dims chosen so that every tp 2 slice
falls on block boundaries (dense / shared / expert intermediate 256; q_b_proj and o_proj 4 heads
x 64): served with tp 2 (two gloo ranks) under the Triton backends (interpreted on CPU). Every
rank's kept tensors are e4m3 (their scales fp32) and byte-equal to the checkpoint's block
slices, and greedy tokens and per-step logprobs equal tp 1's with FP8 kept. At tp 4 every
split slice is 64 wide: a rank's model (built and loaded in process) dequantises those and
names them.
"""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from tiny_models import make_checkpoint
from triton_env import needs_triton

from dsaserve import LLM, SamplingParams
from dsaserve.distributed.parallel_state import ParallelSizes, ParallelState
from dsaserve.engine.shard import load_model
from dsaserve.kernels.block_fp8 import dequantize_block_fp8
from dsaserve.kernels.registry import choose_kernels
from dsaserve.layers.fp8_experts import Fp8Experts
from dsaserve.layers.fp8_linear import Fp8Linear
from dsaserve.model_config import ModelConfig
from dsaserve.models.fp8 import quantize_checkpoint
from dsaserve.models.fp8_keep import checksum, keep_fp8_weights

pytestmark = needs_triton

DIMS = dict(intermediate_size=256, moe_intermediate_size=256, qk_nope_head_dim=48,
            v_head_dim=64, index_topk=64, num_hidden_layers=2)  # fmt: skip
FLAGS = dict(dtype="float32", max_total_tokens=256, page_size=4, moe_runner_backend="triton",
             fp8_gemm_backend="triton", disable_cuda_graph=True)  # fmt: skip
PROMPTS = [[5, 17, 99, 3, 250, 41, 7], [(11 * i) % 290 + 2 for i in range(12)]]
EXPERT_RE = re.compile(r"^(?P<layer>.+\.mlp\.experts)\.(?P<kind>gate_up_proj|down_proj)"
                       r"(?P<scale>_scale_inv)?$")  # fmt: skip


@pytest.fixture(scope="module")
def fp8(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8_tp")
    src = make_checkpoint(root / "src", "glm", seed=5, **DIMS)
    quantize_checkpoint(src, root / "fp8", block=128)  # what scripts/quantize_fp8.py runs
    return root / "fp8"


def _part(tensor: torch.Tensor, local: list[int], rank: int) -> torch.Tensor:
    """Rank `rank`'s part of `tensor` along the one dim its local shape splits."""
    dims = [d for d, (n, m) in enumerate(zip(tensor.shape, local, strict=True)) if n != m]
    if not dims:
        return tensor
    (dim,) = dims
    return tensor.narrow(dim, rank * local[dim], local[dim])


def _expected(f, name: str, local: list[int], rank: int, ep: int) -> torch.Tensor:
    """The checkpoint's bytes of a kept tensor as rank `rank` should hold them (under EP its
    whole experts [rank * E / ep, (rank + 1) * E / ep))."""
    fused = EXPERT_RE.match(name)
    if fused is None:
        return _part(f.get_tensor(name), local, rank)
    first = rank * local[0] if ep > 1 else 0
    suffix = ".weight" + (fused["scale"] or "")
    projs = ("gate_proj", "up_proj") if fused["kind"] == "gate_up_proj" else ("down_proj",)
    per_proj = [local[1] // len(projs), local[2]]
    experts = []
    for e in range(first, first + local[0]):
        parts = [_part(f.get_tensor(f"{fused['layer']}.{e}.{p}{suffix}"), per_proj, rank)
                 for p in projs]  # fmt: skip
        experts.append(torch.cat(parts))
    return torch.stack(experts)


def _run(llm: LLM) -> list[tuple[list[int], list[float]]]:
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, logprobs=0)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    return [(list(o.token_ids), [lp.logprob for lp in o.logprobs]) for o in outs]


@pytest.fixture(scope="module")
def tp1(fp8):
    with LLM(str(fp8), **FLAGS) as one:
        return _run(one), one.engine.fp8_ranks


@pytest.mark.parametrize("ep", [1, 2])
def test_every_rank_keeps_its_block_slices_fp8_and_matches_tp1(fp8, tp1, ep) -> None:
    """tp 2 (each expert's intermediate split in two), or tp 2 ep 2 (4 whole experts a rank)."""
    want, single = tp1
    with LLM(str(fp8), tp_size=2, ep_size=ep, **FLAGS) as llm:
        got = _run(llm)
        reports = llm.engine.fp8_ranks
        stats = llm.engine.stats()["fp8_ranks"]
    assert [r["rank"] for r in stats] == [0, 1]
    # per layer: q_a, q_b, kv_a, o_proj, indexer wq_b / wk (kv_b_proj is dequantised: the
    # absorbed form); gate / up / down of the dense MLP (layer 0) and the shared expert (1)
    assert [r["fp8_linears_kept"] for r in stats] == [2 * 6 + 3 + 3] * 2
    assert single[0].fp8_linears_kept == 2 * 6 + 6
    assert [r["fp8_expert_layers_kept"] for r in stats] == [1, 1]
    with safe_open(str(fp8 / "model.safetensors"), "pt") as f:
        for report in reports:
            names = set(report.tensors)
            assert "model.layers.1.self_attn.o_proj.weight_scale_inv" in names
            assert "model.layers.1.mlp.experts.gate_up_proj_scale_inv" in names
            assert "model.layers.0.self_attn.q_b_proj.weight" in names
            for name, (dtype, shape, digest) in report.tensors.items():
                scale = name.endswith("_scale_inv")
                assert dtype == str(torch.float32 if scale else torch.float8_e4m3fn), name
                want_bytes = _expected(f, name, shape, report.rank, ep)
                assert list(want_bytes.shape) == shape and checksum(want_bytes) == digest, name
    # the two ranks hold different halves (a checksum that saw one rank's bytes twice fails)
    q_b = "model.layers.0.self_attn.q_b_proj.weight"
    assert reports[0].tensors[q_b][2] != reports[1].tensors[q_b][2]
    # the same tokens; logprobs differ by the order of the fp32 sums only: activations are
    # quantised per token and 128 columns, so a slice on block boundaries sees tp 1's blocks
    # and scales, and a row-parallel product is two halves all-reduced instead of one pass.
    # 1e-4: the bound test_parallel_serve.py holds every fp32 TP layout to.
    for (tokens, lps), (want_tokens, want_lps) in zip(got, want, strict=True):
        assert tokens == want_tokens
        assert max(abs(a - b) for a, b in zip(lps, want_lps, strict=True)) < 1e-4


def test_slices_off_the_blocks_are_dequantised_and_named(fp8, caplog) -> None:
    """Rank 1 of tp 4: every split Linear and expert slice is 64 wide (half a block)."""
    args = SimpleNamespace(model_path=str(fp8), moe_runner_backend="triton",
                           fp8_gemm_backend="triton")  # fmt: skip
    config = ModelConfig.from_hf(str(fp8), {})
    kernels = choose_kernels(args, "cpu")
    parallel = ParallelState(ParallelSizes(tp=4), rank=1)

    def keep(model) -> None:
        keep_fp8_weights(model, config.quantization, kernels.names, kernels, str(fp8))

    model = load_model(args, config, torch.float32, torch.device("cpu"), False, parallel,
                       show_progress=False, before_load=keep)  # fmt: skip
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert isinstance(attn.q_a_proj, Fp8Linear)  # replicated: whole, kept
    assert not isinstance(attn.q_b_proj, Fp8Linear) and attn.q_b_proj.weight.dtype == torch.float32
    assert not isinstance(mlp.down_proj, Fp8Linear)
    assert not isinstance(model.model.layers[1].mlp.experts, Fp8Experts)
    named = " ".join(r.getMessage() for r in caplog.records if r.levelname == "WARNING")
    for name in (
        "layers.0.self_attn.q_b_proj.weight",
        "layers.1.self_attn.o_proj.weight",
        "layers.0.mlp.down_proj.weight",
        "layers.1.mlp.shared_experts.up_proj.weight",
    ):
        assert name in named  # fmt: skip
    assert "1 MoE layers' experts are dequantised" in named
    # the dequantised slice is the checkpoint's: q_b rows 64..128 of the whole dequantised weight
    with safe_open(str(fp8 / "model.safetensors"), "pt") as f:
        name = "model.layers.0.self_attn.q_b_proj.weight"
        whole = dequantize_block_fp8(f.get_tensor(name), f.get_tensor(name + "_scale_inv"))
    assert torch.equal(attn.q_b_proj.weight, whole[64:128])


@pytest.mark.parametrize("layout", ["masked", "contiguous"])
def test_the_moe_layouts_leave_out_another_ranks_experts(layout) -> None:
    """Routing ids -1 (an EP rank's view of others' experts) add nothing, in both layouts."""
    from dsaserve.kernels.triton_moe import grouped_experts

    gen = torch.Generator().manual_seed(3)
    experts = SimpleNamespace(gate_up_proj=torch.randn(4, 256, 64, generator=gen) / 8,
                              down_proj=torch.randn(4, 64, 128, generator=gen) / 8)  # fmt: skip
    x = torch.randn(5, 64, generator=gen)
    index = torch.tensor([[0, -1, 2], [-1, -1, 3], [1, 2, -1], [-1, -1, -1], [3, 0, 1]])
    weights = torch.rand(5, 3, generator=gen)
    got = grouped_experts(experts, x, index, weights, layout)
    want = torch.zeros_like(x)
    for t, j in (index >= 0).nonzero().tolist():
        gate, up = (x[t] @ experts.gate_up_proj[index[t, j]].T).chunk(2)
        want[t] += weights[t, j] * (F.silu(gate) * up) @ experts.down_proj[index[t, j]].T
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)
