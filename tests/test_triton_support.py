"""kernels/triton_support.py: the software e4m3 decode (sm_80) and the interpreter's bf16 dot."""

from __future__ import annotations

import pytest
import torch
from triton_env import DEVICE

triton = pytest.importorskip("triton")
tl = triton.language

from dsaserve.kernels.triton_support import e4m3_to_f32  # noqa: E402  (applies the dot fix)


@triton.jit
def _decode(src, dst):
    i = tl.arange(0, 256)
    tl.store(dst + i, e4m3_to_f32(tl.load(src + i)))


@triton.jit
def _matmul(a_ptr, b_ptr, out_ptr, M: tl.constexpr, N: tl.constexpr, K: tl.constexpr):
    m, n, k = tl.arange(0, M), tl.arange(0, N), tl.arange(0, K)
    a = tl.load(a_ptr + m[:, None] * K + k[None, :])
    b = tl.load(b_ptr + k[:, None] * N + n[None, :])
    tl.store(out_ptr + m[:, None] * N + n[None, :], tl.dot(a, b))


def test_e4m3_decode_matches_torch_for_every_byte() -> None:
    raw = torch.arange(256, dtype=torch.uint8, device=DEVICE)
    out = torch.empty(256, device=DEVICE)
    _decode[(1,)](raw, out)
    want = raw.view(torch.float8_e4m3fn).float()
    finite = ~want.isnan()  # 0x7F and 0xFF: e4m3fn's NaN, never written by the quantiser
    assert int(finite.sum()) == 254
    assert torch.equal(out[finite], want[finite])


def test_interpreter_bf16_dot_reads_numbers() -> None:
    """tl.dot over bf16 operands under the interpreter equals the fp32 product of the same
    values (without the fix it multiplies their uint16 bit patterns: errors of ~1e10)."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(16, 32, generator=g).bfloat16().to(DEVICE)
    b = torch.randn(32, 16, generator=g).bfloat16().to(DEVICE)
    out = torch.empty(16, 16, device=DEVICE)
    _matmul[(1,)](a, b, out, 16, 16, 32)
    torch.testing.assert_close(out, a.float() @ b.float(), rtol=1e-6, atol=1e-5)
