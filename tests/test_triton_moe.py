"""The Triton grouped-expert GEMMs (kernels/triton_moe.py) against the torch `moe` op."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from triton_env import DEVICE, gpu, needs_triton

from dsaserve.kernels.block_fp8 import dequantize_block_fp8, quantize_block_fp8
from dsaserve.kernels.static_moe import static_experts

pytestmark = needs_triton

SHAPES = [(5, 3, 8, 64, 32), (1, 2, 8, 96, 48), (20, 4, 6, 128, 160)]  # T, k, E, H, I


class FakeExperts(nn.Module):
    """What the op reads of an `Experts`: gate_up_proj [E, 2I, H], down_proj [E, H, I]."""

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(gate_up, requires_grad=False)
        self.down_proj = nn.Parameter(down, requires_grad=False)


def _routing(tokens: int, top_k: int, experts: int, g: torch.Generator):
    index = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=g)
    return index.to(DEVICE), weights.to(DEVICE)


def _float_experts(e: int, h: int, i: int, g: torch.Generator) -> FakeExperts:
    return FakeExperts((torch.randn(e, 2 * i, h, generator=g) * h**-0.5).to(DEVICE),
                       (torch.randn(e, h, i, generator=g) * i**-0.5).to(DEVICE))  # fmt: skip


@pytest.mark.parametrize("shape", SHAPES)
def test_masked_layout_lists_each_assignment_once(shape) -> None:
    from dsaserve.kernels.triton_moe import masked_layout

    tokens, top_k, experts, _, _ = shape
    index, _ = _routing(tokens, top_k, experts, torch.Generator().manual_seed(0))
    layout = masked_layout(index, experts)
    table = layout.rows.view(experts, -1)
    for e in range(experts):
        listed = table[e][table[e] >= 0]
        want = (index.flatten() == e).nonzero()[:, 0]
        assert listed.tolist() == want.tolist()  # in assignment order, padded after
        assert (table[e][len(listed) :] == -1).all()
    per_expert = table.shape[1] // 16  # row blocks of each expert
    assert layout.experts.tolist() == [b // per_expert for b in range(len(layout.experts))]


@pytest.mark.parametrize("layout", ["masked", "contiguous"])
@pytest.mark.parametrize("shape", SHAPES)
def test_grouped_experts_float_matches_torch(shape, layout) -> None:
    from dsaserve.kernels.triton_moe import grouped_experts

    tokens, top_k, e, h, i = shape
    g = torch.Generator().manual_seed(tokens)
    experts = _float_experts(e, h, i, g)
    x = torch.randn(tokens, h, generator=g).to(DEVICE)
    index, weights = _routing(tokens, top_k, e, g)
    want = static_experts(experts, x, index, weights)
    # idle experts' weights are never used: poison them
    idle = torch.ones(e, dtype=torch.bool)
    idle[index.flatten().cpu()] = False
    experts.gate_up_proj[idle.to(DEVICE)] = float("nan")
    experts.down_proj[idle.to(DEVICE)] = float("nan")
    got = grouped_experts(experts, x, index, weights, layout)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout", ["masked", "contiguous"])
def test_grouped_experts_bf16_on_tensor_core_tiles(layout) -> None:
    """bf16 weights and activations: 16-bit dots with fp32 accumulation (the masked layout's
    16-row blocks swap-AB), against the fp32 torch op over the same bf16 values."""
    from dsaserve.kernels.triton_moe import grouped_experts
    from dsaserve.kernels.triton_tile import tile

    tokens, top_k, e, h, i = SHAPES[2]
    g = torch.Generator().manual_seed(4)
    experts = _float_experts(e, h, i, g)
    x = torch.randn(tokens, h, generator=g).bfloat16().to(DEVICE)
    index, weights = _routing(tokens, top_k, e, g)
    for name in ("gate_up_proj", "down_proj"):
        setattr(experts, name, nn.Parameter(getattr(experts, name).bfloat16(), requires_grad=False))
    want = static_experts(FakeExperts(experts.gate_up_proj.float(), experts.down_proj.float()),
                          x.float(), index, weights)  # fmt: skip
    assert tile(16, x.dtype, torch.bfloat16, x.device).SWAP
    assert not tile(64, x.dtype, torch.bfloat16, x.device).SWAP
    got = grouped_experts(experts, x, index, weights, layout)
    assert got.dtype == torch.bfloat16
    error = ((got.float() - want).norm() / want.norm()).item()
    assert error < 1e-2, error  # the hidden activation and the output rounded to bf16


def test_software_e4m3_experts_equal_the_hardware_ones() -> None:
    """sm_80: weights and activations read as bytes and decoded with integer ops to fp16."""
    from dsaserve.kernels.gpu_target import as_target
    from dsaserve.kernels.triton_moe import grouped_experts

    g = torch.Generator().manual_seed(5)
    experts = _float_experts(4, 128, 128, g)
    for name in ("gate_up_proj", "down_proj"):
        w8, scale = quantize_block_fp8(getattr(experts, name).cpu())
        setattr(experts, name, nn.Parameter(w8.to(DEVICE), requires_grad=False))
        setattr(experts, f"{name}_scale_inv", nn.Parameter(scale.to(DEVICE), requires_grad=False))
    x = torch.randn(5, 128, generator=g).to(DEVICE)
    index, weights = _routing(5, 2, 4, g)
    hardware = grouped_experts(experts, x, index, weights)
    with as_target(8, 0):
        software = grouped_experts(experts, x, index, weights)
    torch.testing.assert_close(software, hardware, rtol=1e-6, atol=1e-6)


def _quantised_reference(x, index, weights, gate_up8, gate_scale, down8, down_scale):
    """The FP8 op's exact math in fp64: both operands of each GEMM quantised, then dequantised."""
    from dsaserve.kernels.triton_fp8_gemm import act_quant

    def dq_act(a):
        a8, scale = act_quant(a)
        return a8.double() * scale.double().repeat_interleave(128, 1)[:, : a.shape[1]]

    gate_up = dequantize_block_fp8(gate_up8, gate_scale).double()
    down = dequantize_block_fp8(down8, down_scale).double()
    out = torch.zeros(x.shape, dtype=torch.float64, device=x.device)
    a = dq_act(x)
    for t in range(x.shape[0]):
        for j in range(index.shape[1]):
            e = index[t, j]
            gate, up = (a[t] @ gate_up[e].T).chunk(2)
            h = dq_act((F.silu(gate) * up).float()[None])[0]
            out[t] += weights[t, j].double() * (h @ down[e].T)
    return out


@pytest.mark.parametrize("layout", ["masked", "contiguous"])
def test_grouped_experts_block_fp8(layout) -> None:
    from dsaserve.kernels.triton_moe import grouped_experts

    tokens, top_k, e, h, i = 6, 3, 8, 256, 160  # partial scale blocks along I
    g = torch.Generator().manual_seed(1)
    gate_up8, gate_scale = quantize_block_fp8(torch.randn(e, 2 * i, h, generator=g) * 0.1)
    down8, down_scale = quantize_block_fp8(torch.randn(e, h, i, generator=g) * 0.1)
    experts = FakeExperts(gate_up8.to(DEVICE), down8.to(DEVICE))
    experts.gate_up_proj_scale_inv = nn.Parameter(gate_scale.to(DEVICE), requires_grad=False)
    experts.down_proj_scale_inv = nn.Parameter(down_scale.to(DEVICE), requires_grad=False)
    x = torch.randn(tokens, h, generator=g).to(DEVICE)
    index, weights = _routing(tokens, top_k, e, g)
    got = grouped_experts(experts, x, index, weights, layout)
    want = _quantised_reference(x, index, weights, *(t.to(DEVICE) for t in (
        gate_up8, gate_scale, down8, down_scale)))  # fmt: skip
    # the hidden activation is re-quantised between the GEMMs: a value next to an e4m3 rounding
    # boundary may flip by 1/16 when the fp32 sum order differs, hence 1e-3 and not 1e-5
    assert ((got.double() - want).norm() / want.norm()).item() < 1e-3
    # and the torch op (dequantised weights, unquantised activations): e4m3 activation error
    ref = static_experts(experts, x, index, weights)
    assert ((got - ref).norm() / ref.norm()).item() < 0.05


def test_layouts_need_no_host_read() -> None:
    from dsaserve.kernels.triton_moe import contiguous_layout, masked_layout

    index = torch.empty(4, 3, dtype=torch.long, device="meta")  # any host read raises here
    layout = masked_layout(index, 8)
    assert layout.rows.shape == (8 * 16,) and layout.experts.shape == (8,)
    layout = contiguous_layout(index, 8, block_m=4)  # sized by T*k + min(E, T*k) * (4 - 1)
    assert layout.rows.shape == (12 + 8 * 3,) and layout.experts.shape == (9,)


def _skewed(tokens: int, top_k: int, experts: int, g: torch.Generator):
    """Uneven routing: expert 1 in every row, the upper half of the experts never chosen."""
    busy = experts // 2
    index = torch.stack([torch.cat([torch.tensor([1]), 2 + torch.randperm(busy - 2, generator=g)
                                    [: top_k - 1]]) for _ in range(tokens)])  # fmt: skip
    index[::3, 1] = 0  # expert 0 in a third of the rows only
    return index.to(DEVICE), torch.rand(tokens, top_k, generator=g).to(DEVICE)


def test_contiguous_layout_groups_uneven_and_idle_experts() -> None:
    from dsaserve.kernels.triton_moe import contiguous_layout

    experts, block_m = 10, 4
    index, _ = _skewed(9, 3, experts, torch.Generator().manual_seed(2))
    layout = contiguous_layout(index, experts, block_m)
    rows, owner = layout.rows.view(-1, block_m), layout.experts
    seen = []
    for e in range(experts):
        want = (index.flatten() == e).nonzero()[:, 0].tolist()
        blocks = rows[owner == e] if want else rows[:0]
        listed = blocks[blocks >= 0].tolist()
        assert listed == want  # every assignment of e, in order, in e's blocks only
        assert len(blocks) == -(-len(want) // block_m)  # padded to block_m, no more
        if e >= experts // 2:
            assert not want and len(blocks) == 0  # idle experts own no block
        seen += listed
    assert sorted(seen) == list(range(index.numel()))
    used = sum(-(-int((index == e).sum()) // block_m) for e in range(experts))
    assert (rows[used:] == -1).all()  # the bound's tail is padding only


@pytest.mark.parametrize("fp8", [False, True])
def test_prefill_sized_contiguous_matches_torch(fp8: bool) -> None:
    """More rows than the masked layout takes (`auto` picks contiguous: one launch a GEMM over
    every expert's run), with uneven counts, idle experts and one expert in every row."""
    from dsaserve.kernels import triton_moe

    tokens, top_k, e, h, i = 96, 4, 12, 128, 128
    g = torch.Generator().manual_seed(3)
    experts = _float_experts(e, h, i, g)
    if fp8:
        for name in ("gate_up_proj", "down_proj"):
            w8, scale = quantize_block_fp8(getattr(experts, name).cpu())
            setattr(experts, name, nn.Parameter(w8.to(DEVICE), requires_grad=False))
            scale = nn.Parameter(scale.to(DEVICE), requires_grad=False)
            setattr(experts, f"{name}_scale_inv", scale)
    x = torch.randn(tokens, h, generator=g).to(DEVICE)
    index, weights = _skewed(tokens, top_k, e, g)
    assert tokens > triton_moe.MASKED_MAX_TOKENS
    got = triton_moe.grouped_experts(experts, x, index, weights)
    if not fp8:
        torch.testing.assert_close(got, static_experts(experts, x, index, weights),
                                   rtol=1e-5, atol=1e-5)  # fmt: skip
        return
    want = _quantised_reference(x, index, weights, experts.gate_up_proj,
                                experts.gate_up_proj_scale_inv, experts.down_proj,
                                experts.down_proj_scale_inv)  # fmt: skip
    assert ((got.double() - want).norm() / want.norm()).item() < 1e-3  # as the fp8 test above
    masked = triton_moe.grouped_experts(experts, x, index, weights, "masked")
    assert ((got - masked).norm() / masked.norm()).item() < 1e-3


@pytest.mark.gpu
@gpu
def test_grouped_experts_at_glm_tp8_shapes() -> None:
    """256 experts with an eighth of each (I = 256), hidden 6144, top-8, batch 32."""
    from dsaserve.kernels.triton_moe import grouped_experts

    g = torch.Generator().manual_seed(0)
    e, h, i, tokens = 256, 6144, 256, 32
    gate_up8, gate_scale = quantize_block_fp8(torch.randn(e, 2 * i, h, generator=g) * 0.02)
    down8, down_scale = quantize_block_fp8(torch.randn(e, h, i, generator=g) * 0.02)
    experts = FakeExperts(gate_up8.cuda(), down8.cuda())
    experts.gate_up_proj_scale_inv = nn.Parameter(gate_scale.cuda(), requires_grad=False)
    experts.down_proj_scale_inv = nn.Parameter(down_scale.cuda(), requires_grad=False)
    x = torch.randn(tokens, h, generator=g).cuda().bfloat16()
    index, weights = _routing(tokens, 8, e, g)
    got = grouped_experts(experts, x, index.cuda(), weights.cuda())
    ref = static_experts(experts, x.float(), index.cuda(), weights.cuda())
    assert ((got.float() - ref).norm() / ref.norm()).item() < 0.05
