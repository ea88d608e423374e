"""The Triton block-FP8 GEMM against the dequantised torch reference."""

from __future__ import annotations

import pytest
import torch
from triton_env import DEVICE, needs_triton

from dsaserve.kernels import reference
from dsaserve.kernels.block_fp8 import dequantize_block_fp8, quantize_block_fp8

pytestmark = needs_triton


@pytest.mark.parametrize("m,n,k", [(3, 200, 300), (20, 128, 256)])
def test_block_fp8_gemm_matches_dequantised(m: int, n: int, k: int) -> None:
    from dsaserve.kernels import triton_fp8_gemm as tk

    g = torch.Generator().manual_seed(m)
    w8, scale = (t.to(DEVICE) for t in quantize_block_fp8(torch.randn(n, k, generator=g)))
    x = torch.randn(m, k, generator=g).to(DEVICE)
    a8, a_scale = tk.act_quant(x)
    got = tk.fp8_gemm(a8, a_scale, w8, scale)
    # exact product of the two quantised operands (both dequantised), in fp64
    a = a8.double().view(m, -1) * a_scale.double().repeat_interleave(128, 1)[:, :k]
    want = a @ dequantize_block_fp8(w8, scale).double().T
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-3)
    # and close to the reference linear (which keeps x unquantised): e4m3 error on x only
    ref = reference.fp8_linear(x, w8, scale)
    y = tk.fp8_linear(x, w8, scale)
    assert ((y - ref).norm() / ref.norm()).item() < 0.05


def test_software_e4m3_gemm_equals_the_hardware_one() -> None:
    """sm_80 reads both e4m3 operands as bytes and decodes them to fp16 (exact) for the dot."""
    from dsaserve.kernels import triton_fp8_gemm as tk
    from dsaserve.kernels.gpu_target import as_target

    g = torch.Generator().manual_seed(7)
    w8, scale = (t.to(DEVICE) for t in quantize_block_fp8(torch.randn(256, 384, generator=g)))
    for m in (5, 40):  # a swapped 16-row tile and a 64-row one
        a8, a_scale = tk.act_quant(torch.randn(m, 384, generator=g).to(DEVICE))
        hardware = tk.fp8_gemm(a8, a_scale, w8, scale)
        with as_target(8, 0):
            software = tk.fp8_gemm(a8, a_scale, w8, scale)
        torch.testing.assert_close(software, hardware, rtol=1e-6, atol=1e-6)
