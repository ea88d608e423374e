"""The DeepGEMM / FlashMLA adapters behind the seam (kernels/deep_gemm_adapter.py,
kernels/flash_mla_adapter.py): chosen only when their package imports on CUDA, else the Triton
kernel (CUDA) or a refusal (CPU). Neither package exists here, so stand-in modules computing
the documented contract in torch (padding rows left as NaN, as the real kernels leave them
unwritten) check the adapters' plumbing; the real kernels have never run.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch
from torch import nn
from triton_env import needs_triton

from dsaserve.args import ServerArgs
from dsaserve.kernels import reference, registry
from dsaserve.kernels.block_fp8 import dequantize_block_fp8, quantize_block_fp8
from dsaserve.kernels.kv_quant import KV_STORE, quantize_entry
from dsaserve.kernels.registry import BackendError, choose_kernels, resolve

pytestmark = needs_triton
ADAPTERS = ("dsaserve.kernels.deep_gemm_adapter", "dsaserve.kernels.flash_mla_adapter")


def _dq_act(a8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return a8.float() * scale.repeat_interleave(128, -1)[..., : a8.shape[-1]]


def _fake_deep_gemm() -> types.ModuleType:
    def fp8_gemm_nt(a, w, out):
        out.copy_(_dq_act(*a) @ dequantize_block_fp8(*w).T)

    def m_grouped_fp8_gemm_nt_masked(a, w, out, masked_m, expected_m):
        assert expected_m >= 1
        weights = dequantize_block_fp8(*w)
        out.fill_(float("nan"))
        for e, m in enumerate(masked_m.tolist()):
            out[e, :m] = _dq_act(a[0][e, :m], a[1][e, :m]) @ weights[e].T

    def m_grouped_fp8_gemm_nt_contiguous(a, w, out, m_indices):
        blocks = m_indices.view(-1, 128)  # each aligned block one expert's (or padding)
        assert ((blocks == blocks.max(1).values[:, None]) | (blocks == -1)).all()
        weights = dequantize_block_fp8(*w)
        out.fill_(float("nan"))
        for r, e in enumerate(m_indices.tolist()):
            if e >= 0:
                out[r] = _dq_act(a[0][r], a[1][r]) @ weights[e].T

    fake = types.ModuleType("deep_gemm")
    fake.fp8_gemm_nt = fp8_gemm_nt
    fake.m_grouped_fp8_gemm_nt_masked = m_grouped_fp8_gemm_nt_masked
    fake.m_grouped_fp8_gemm_nt_contiguous = m_grouped_fp8_gemm_nt_contiguous
    fake.get_m_alignment_for_contiguous_layout = lambda: 128
    return fake


def _fake_flash_mla() -> types.ModuleType:
    def flash_mla_with_kvcache(q, k_cache, block_table, seqlens, head_dim_v, metadata, splits,
                               scale, causal, is_fp8, indices):  # fmt: skip
        assert block_table is None and is_fp8 and not causal and q.shape[2] % 64 == 0
        idx = indices[:, 0].long()
        keys = KV_STORE.read_entry(k_cache.view(-1, 656), idx.clamp(min=0), 512, torch.float32)
        scores = torch.einsum("bhc,blc->bhl", q[:, 0].float(), keys) * scale
        probs = scores.masked_fill((idx < 0)[:, None], float("-inf")).softmax(-1)
        out = torch.einsum("bhl,blr->bhr", probs, keys[..., :head_dim_v])
        return out[:, None].bfloat16(), None

    fake = types.ModuleType("flash_mla")
    fake.get_mla_metadata = lambda *args: ("metadata", None)
    fake.flash_mla_with_kvcache = flash_mla_with_kvcache
    return fake


@pytest.fixture
def modules(monkeypatch):
    """Install (a module) or hide (None) `deep_gemm` / `flash_mla`; the registry re-imports."""

    def install(deep_gemm, flash_mla) -> None:
        for name in ADAPTERS:
            monkeypatch.delitem(sys.modules, name, raising=False)
        monkeypatch.setitem(sys.modules, "deep_gemm", deep_gemm)
        monkeypatch.setitem(sys.modules, "flash_mla", flash_mla)
        registry.load.cache_clear()

    yield install
    registry.load.cache_clear()
    for name in ADAPTERS:
        sys.modules.pop(name, None)


def test_vendor_backends_only_where_they_import(modules) -> None:
    flag = "--moe-runner-backend"
    modules(_fake_deep_gemm(), _fake_flash_mla())
    assert resolve("moe", "deep_gemm", "cuda", flag) == "deep_gemm"
    assert resolve("fp8_gemm", "deep_gemm", "cuda", flag) == "deep_gemm"
    for name in ("flashmla_sparse", "flashmla_kv", "flashmla_auto"):
        assert resolve("sparse_mla", name, "cuda", flag) == "flashmla"
    assert resolve("moe", "auto", "cuda", flag) == "triton"  # never run: no auto pick
    args = ServerArgs(moe_runner_backend="deep_gemm", fp8_gemm_backend="deep_gemm",
                      dsa_decode_backend="flashmla_kv")  # fmt: skip
    kernels = choose_kernels(args, "cuda")
    assert kernels.names["moe"] == kernels.names["fp8_gemm"] == "deep_gemm"
    assert kernels.names["sparse_mla"] == "flashmla" and kernels.names["indexer"] == "triton"
    assert kernels.moe.__module__ == "dsaserve.kernels.deep_gemm_adapter"
    with pytest.raises(BackendError, match="a CUDA kernel; on CPU"):
        resolve("moe", "deep_gemm", "cpu", flag)  # importable, but not on CPU
    modules(None, None)  # `import deep_gemm` raises ImportError
    assert resolve("moe", "deep_gemm", "cuda", flag) == "triton"
    assert resolve("fp8_gemm", "deep_gemm", "cuda", flag) == "triton"
    assert resolve("sparse_mla", "flashmla_sparse", "cuda", flag) == "triton"


def _experts(e: int, h: int, i: int, g: torch.Generator) -> nn.Module:
    experts = nn.Module()
    for name, shape in (("gate_up_proj", (e, 2 * i, h)), ("down_proj", (e, h, i))):
        w8, scale = quantize_block_fp8(torch.randn(*shape, generator=g) * 0.1)
        setattr(experts, name, nn.Parameter(w8, requires_grad=False))
        setattr(experts, f"{name}_scale_inv", nn.Parameter(scale, requires_grad=False))
    return experts


@pytest.mark.parametrize("layout", ["masked", "contiguous"])
def test_deep_gemm_moe_adapter_gives_the_triton_result(modules, layout) -> None:
    modules(_fake_deep_gemm(), None)
    from dsaserve.kernels import deep_gemm_adapter, triton_moe

    g = torch.Generator().manual_seed(0)
    tokens, top_k, e, h, i = 9, 3, 6, 128, 128
    experts = _experts(e, h, i, g)
    x = torch.randn(tokens, h, generator=g)
    index = torch.stack([torch.randperm(e - 2, generator=g)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=g)  # experts 4 and 5 idle
    got = deep_gemm_adapter.grouped_experts(experts, x, index, weights, layout)
    assert got.isfinite().all()  # the NaN padding rows never reach the output
    want = _bf16_out_reference(experts, x, index, weights)
    assert ((got - want).norm() / want.norm()).item() < 1e-3  # an e4m3 flip, as triton_moe's
    # the Triton kernel keeps the GEMM outputs in fp32: the bf16 rounding (2^-9) of the gate_up
    # output moves hidden values across e4m3 rounding boundaries (steps of 2^-4): ~2%
    triton = triton_moe.grouped_experts(experts, x, index, weights, layout)
    assert ((got - triton).norm() / triton.norm()).item() < 0.05


def _bf16_out_reference(experts, x, index, weights) -> torch.Tensor:
    """The adapter's math in torch: e4m3 activations, dequantised weights, bf16 GEMM outputs."""
    from dsaserve.kernels.triton_fp8_gemm import act_quant

    tokens, top_k = index.shape
    flat = index.reshape(-1)
    w1 = dequantize_block_fp8(experts.gate_up_proj, experts.gate_up_proj_scale_inv)[flat]
    w2 = dequantize_block_fp8(experts.down_proj, experts.down_proj_scale_inv)[flat]
    rows = _dq_act(*act_quant(x)).repeat_interleave(top_k, 0)[:, None]
    gate_up = torch.bmm(rows, w1.transpose(1, 2))[:, 0].bfloat16().float()
    gate, up = gate_up.chunk(2, dim=-1)
    hidden = _dq_act(*act_quant(torch.nn.functional.silu(gate) * up))[:, None]
    y = torch.bmm(hidden, w2.transpose(1, 2))[:, 0].bfloat16().float().view(tokens, top_k, -1)
    return (y * weights[..., None]).sum(1)


def test_deep_gemm_linear_adapter(modules) -> None:
    modules(_fake_deep_gemm(), None)
    from dsaserve.kernels import deep_gemm_adapter

    g = torch.Generator().manual_seed(1)
    w8, scale = quantize_block_fp8(torch.randn(96, 200, generator=g))
    x, bias = torch.randn(2, 3, 200, generator=g), torch.randn(96, generator=g)
    got = deep_gemm_adapter.fp8_linear(x, w8, scale, bias)
    want = reference.fp8_linear(x, w8, scale, bias)
    assert got.shape == (2, 3, 96) and ((got - want).norm() / want.norm()).item() < 0.05


def test_flash_mla_adapter_gives_the_reference_attention(modules) -> None:
    modules(None, _fake_flash_mla())
    from dsaserve.kernels import flash_mla_adapter

    g = torch.Generator().manual_seed(2)
    batch, heads, topk, slots = 3, 8, 16, 128  # 8 heads a rank: padded to 64
    cache = quantize_entry(torch.randn(slots, 576, generator=g), 512)
    q = torch.randn(batch, heads, 576, generator=g)
    table = torch.stack([torch.randperm(slots, generator=g)[:topk] for _ in range(batch)])
    allowed = torch.rand(batch, topk, generator=g) < 0.8
    allowed[:, 0] = True
    scale = 192**-0.5
    got = flash_mla_adapter.sparse_mla_decode(q, cache, table, allowed, 512, scale)
    want = reference.sparse_mla_decode(q, cache, table, allowed, 512, scale)
    assert got.shape == want.shape == (batch, heads, 512)
    assert ((got - want).norm() / want.norm()).item() < 1e-2  # q and the output in bf16
    # a bf16 cache is not FlashMLA's layout: the Triton kernel runs it
    plain = torch.randn(slots, 576, generator=g)
    fallback = flash_mla_adapter.sparse_mla_decode(q, plain, table, allowed, 512, scale)
    torch.testing.assert_close(fallback, reference.sparse_mla_decode(q, plain, table, allowed,
                                                                     512, scale),
                               rtol=1e-4, atol=1e-4)  # fmt: skip
