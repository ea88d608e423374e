"""Byte sizes of the FP8 KV layouts (kernels/kv_quant.py), torch-free for the deploy planner."""

from __future__ import annotations

import math

GROUP = 128  # latent values per fp32 scale


def group_size(rank: int) -> int:
    """Latent values per scale: 128, or the largest power of two dividing a smaller rank."""
    return math.gcd(rank, GROUP)


def mla_entry_bytes(rank: int, rope: int) -> int:
    """Bytes of one FP8 MLA entry: latent e4m3 + fp32 scales + bf16 rope (656 for 512/64)."""
    return rank + 4 * (rank // group_size(rank)) + 2 * rope


def index_key_bytes(dim: int) -> int:
    """Bytes of one FP8 index key: e4m3 values + one fp32 scale (132 for 128)."""
    return dim + 4
