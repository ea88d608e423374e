"""NVFP4 (NVIDIA Model Optimizer) e2m1 weights: the format, its dequantisation and quantisation.

A quantised weight [out, in] is stored as uint8 [out, in/2] e2m1 codes (two per byte, element 2i
in the low nibble), float8_e4m3fn [out, in/16] scales (one per 16 consecutive inputs) and a
float32 global scale: W = e2m1(code) * (float(scale) * scale_2). Reading and writing checkpoint
folders is models/nvfp4.py's.
"""

from __future__ import annotations

import torch

GROUP = 16
E2M1_MAX, E4M3_MAX = 6.0, 448.0
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # codes 0-7; 8-15 are their negatives
SCALE, SCALE_2 = "_scale", "_scale_2"  # suffixes of a weight's name


def _lut(device: torch.device) -> torch.Tensor:
    values = torch.tensor(E2M1_VALUES, device=device)
    return torch.cat([values, -values])


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., n/2] -> float32 [..., n] (low nibble first)."""
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2)
    return _lut(packed.device)[codes.long()]


def pack_e2m1(values: torch.Tensor) -> torch.Tensor:
    """float [..., n] of e2m1 values -> uint8 [..., n/2] (the nearest code; ties to even)."""
    lut = _lut(values.device)
    codes = (values[..., None] - lut[:8].copysign(values[..., None])).abs().argmin(-1)
    codes = codes + 8 * (values < 0)  # the sign bit
    codes = codes.to(torch.uint8).unflatten(-1, (-1, 2))
    return codes[..., 0] | (codes[..., 1] << 4)


def dequantize_nvfp4(
    packed: torch.Tensor, weight_scale: torch.Tensor, weight_scale_2: torch.Tensor
) -> torch.Tensor:
    """W [out, in] float32 of an NVFP4 weight; ValueError on mismatched shapes."""
    out_dim, half = packed.shape[-2:]
    if tuple(weight_scale.shape[-2:]) != (out_dim, 2 * half // GROUP):
        raise ValueError(f"weight_scale shape {list(weight_scale.shape)} does not fit packed "
                         f"weight {list(packed.shape)} with groups of {GROUP}")  # fmt: skip
    values = unpack_e2m1(packed).unflatten(-1, (-1, GROUP))  # [out, in/16, 16]
    scale = weight_scale.float()[..., None] * weight_scale_2.float()
    return (values * scale).flatten(-2)


def quantize_nvfp4(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """ModelOpt's recipe: global scale amax / (6 * 448), per-16 e4m3 scales, e2m1 codes."""
    if w.shape[-1] % GROUP:
        raise ValueError(f"in_features {w.shape[-1]} is not a multiple of {GROUP}")
    w = w.float()
    amax = w.abs().amax()
    global_scale = amax / (E2M1_MAX * E4M3_MAX) if amax > 0 else torch.tensor(1.0)
    groups = w.unflatten(-1, (-1, GROUP))
    block = (groups.abs().amax(-1) / E2M1_MAX / global_scale).clamp(max=E4M3_MAX)
    block8 = block.to(torch.float8_e4m3fn)
    denom = block8.float()[..., None] * global_scale
    scaled = torch.where(denom > 0, groups / denom, torch.zeros_like(groups))
    return {
        "": pack_e2m1(scaled.clamp(-E2M1_MAX, E2M1_MAX).flatten(-2)),
        SCALE: block8,
        SCALE_2: global_scale.float().reshape(()),
    }
