"""Triton pieces the kernels share: the e4m3 decode for a GPU without FP8, and the interpreter's
bf16 dot.

Under the interpreter (TRITON_INTERPRET=1: the CPU tests, `--*-backend triton` on CPU) `tl.dot`
multiplies bf16 operands as their uint16 bit patterns; `fix_interpreter_dot` (applied on import
while interpreting) gives it fp32 copies instead, which is what a tensor core computes (bf16
products are exact in fp32), so the kernels' bf16 dots are checked on CPU too.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl


@triton.jit
def e4m3_to_f32(raw):
    """e4m3fn bytes (uint8) -> fp32, with integer ops only: 2^(e-7) * (1 + m/8), or m * 2^-9
    for e = 0 (the quantiser clamps to +-448, so the NaN pattern never occurs)."""
    bits = raw.to(tl.uint32)
    exponent = (bits >> 3) & 0xF
    mantissa = bits & 0x7
    normal = (((exponent + 120) << 23) | (mantissa << 20)).to(tl.float32, bitcast=True)
    value = tl.where(exponent == 0, mantissa.to(tl.float32) * 0.001953125, normal)
    return tl.where((bits & 0x80) != 0, -value, value)


@triton.jit
def load_e4m3(ptrs, mask, SOFT: tl.constexpr):
    """The e4m3 bytes at `ptrs` as fp32 (0 where not `mask`): converted in hardware (sm_89+),
    or decoded with integer ops (SOFT: sm_80)."""
    raw = tl.load(ptrs, mask=mask, other=0)
    if SOFT:  # one return: after an early one Triton would still emit the e4m3 conversion
        value = e4m3_to_f32(raw)
    else:
        value = raw.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    return value


def fix_interpreter_dot() -> None:
    """Make the interpreter's tl.dot read bf16 operands as numbers (once)."""
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    original = builder.create_dot
    if getattr(original, "reads_bf16", False):
        return

    def create_dot(self, a, b, *rest):
        a, b = (self.cast_impl(x, tl.float32) if x.dtype.scalar == tl.bfloat16 else x
                for x in (a, b))  # fmt: skip
        return original(self, a, b, *rest)

    create_dot.reads_bf16 = True
    builder.create_dot = create_dot


if os.environ.get("TRITON_INTERPRET") == "1":
    fix_interpreter_dot()
