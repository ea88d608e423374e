"""What the GPU under the Triton kernels can do (torch only: the registry asks before any import).

The kernels are compiled and checked ahead of time for sm_90 (H100 / H200) and sm_100 (B200 /
B300) in CI (tests/test_gpu_compile.py); sm_89 (L40S) and sm_120 (RTX PRO 6000) convert e4m3 in
hardware as well and get the same kernels; sm_80 (A100) has no FP8 conversion, so there the
kernels read FP8 bytes as uint8 and decode them with integer ops (exact: every e4m3 value is an
fp16 one), then run fp16 / bf16 dots. Below sm_80, and on ROCm, an explicit `triton` backend is
refused at start (`unsupported`: one line naming the GPU) and `auto` takes torch.
bench/gpu_check_compile.py pretends to be a target with `as_target`, so the launch code picks
what it would pick there. The e4m3 decode itself is in kernels/triton_support.py.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

OLDEST = (8, 0)  # Ampere: tl.dot on tensor cores in bf16 / fp16
FP8_HARDWARE = (8, 9)  # Ada and later convert e4m3 (cvt.*.e4m3x2) and multiply it
_forced: list[tuple[int, int]] = []


@contextlib.contextmanager
def as_target(major: int, minor: int) -> Iterator[None]:
    """Launch code in this block chooses as if on compute capability major.minor."""
    _forced.append((major, minor))
    try:
        yield
    finally:
        _forced.pop()


def capability(device: torch.device) -> tuple[int, int]:
    """The compute capability the kernels are launched for (Hopper's without a GPU: on CPU the
    interpreter converts FP8 itself)."""
    if _forced:
        return _forced[-1]
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_capability(device)
    return (9, 0)


def fp8_in_hardware(device: torch.device) -> bool:
    return capability(device) >= FP8_HARDWARE


def has_wgmma(device: torch.device) -> bool:
    """Hopper's wgmma or Blackwell datacenter's tcgen05 (sm_90, sm_100 / sm_103; sm_120 has
    mma.sync only): tiles with M = 64 pay off there."""
    return capability(device)[0] in (9, 10)


def unsupported(device: torch.device) -> str | None:
    """Why the Triton kernels cannot run on this GPU (one line naming it), or None."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device) if torch.cuda.is_available() else "this GPU"
    if torch.version.hip:  # ROCm answers as "cuda" with a gfx capability; e4m3 is fnuz there
        return f"{name} (ROCm): dsaserve's Triton kernels are built for NVIDIA GPUs only"
    if capability(device) >= OLDEST:
        return None
    major, minor = capability(device)
    return f"{name} (sm_{major}{minor}): dsaserve's Triton kernels need sm_80 or newer"
