"""Rotary embeddings: default and YaRN frequencies, interleaved (GPT-J) or half-split (NeoX) pairs.

The frequencies are computed with the same float32 operations as transformers, so cos/sin are
bit-identical to the reference. Both layouts rotate pair (a, b) by the same angle; interleaved
takes pairs (2i, 2i+1) and writes them de-interleaved (evens then odds), as transformers does.
Queries and keys are permuted alike, so dot products are unchanged.
"""

from __future__ import annotations

import math

import torch

from dsaserve.model_config import RopeConfig, yarn_mscale


def inv_freq_and_scale(rope: RopeConfig) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [dim/2] (float32) and the cos/sin attention factor."""
    pos_freqs = rope.theta ** (
        torch.arange(0, rope.dim, 2, dtype=torch.float, device="cpu") / rope.dim
    )
    extrapolation = 1.0 / pos_freqs
    if rope.yarn_factor is None:
        return extrapolation, 1.0
    factor = rope.yarn_factor
    interpolation = 1.0 / (factor * pos_freqs)
    low, high = _correction_range(rope)
    high = high + 0.001 if low == high else high
    ramp = torch.clamp(
        (torch.arange(rope.dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low), 0, 1
    )
    extrapolation_factor = 1 - ramp
    inv = interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor
    if rope.mscale and rope.mscale_all_dim:
        scale = yarn_mscale(factor, rope.mscale) / yarn_mscale(factor, rope.mscale_all_dim)
    else:
        scale = yarn_mscale(factor, 1.0)
    return inv, float(scale)


def _correction_range(rope: RopeConfig) -> tuple[float, float]:
    def dim_for(rotations: float) -> float:
        ratio = rope.original_max_position / (rotations * 2 * math.pi)
        return rope.dim * math.log(ratio) / (2 * math.log(rope.theta))

    low, high = dim_for(rope.beta_fast), dim_for(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, rope.dim - 1)


class Rotary:
    """cos/sin for a batch of positions, shared by MLA and the indexer of every layer."""

    def __init__(self, rope: RopeConfig, device: torch.device | str = "cpu") -> None:
        inv_freq, self.scale = inv_freq_and_scale(rope)
        self.inv_freq = inv_freq.to(device)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        freqs = positions[:, None].float() * self.inv_freq[None, :]  # [T, dim/2]
        return (freqs.cos() * self.scale).to(dtype), (freqs.sin() * self.scale).to(dtype)


def apply_rotary(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool
) -> torch.Tensor:
    """Rotate the last dim of x [T, ..., dim] with cos/sin [T, dim/2]."""
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[1],)
    cos, sin = cos.view(shape), sin.view(shape)
    if interleave:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def rotation(cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    """[T, d, d] matrices R with x @ R == apply_rotary(x, cos, sin, interleave) per row."""
    tokens, half = cos.shape
    rot = cos.new_zeros(tokens, 2 * half, 2 * half)
    idx = torch.arange(half)
    first, second = (2 * idx, 2 * idx + 1) if interleave else (idx, idx + half)
    # out[:, :half] = x1 cos - x2 sin; out[:, half:] = x2 cos + x1 sin
    rot[:, first, idx] = cos
    rot[:, second, idx] = -sin
    rot[:, second, idx + half] = cos
    rot[:, first, idx + half] = sin
    return rot
