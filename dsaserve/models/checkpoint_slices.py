"""Read one rank's slice of a checkpoint tensor without reading the rest (safetensors slices).

A block-FP8 weight is read over the whole 128 x 128 blocks that cover the slice, with the matching
rows and columns of its `weight_scale_inv`, dequantised, then cut to the slice.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from dsaserve.kernels.block_fp8 import dequantize_block_fp8
from dsaserve.layers.linear import ExpertShard, Shard

Index = tuple[slice, ...]
ReadScale = Callable[[Index], torch.Tensor]


def shard_pieces(shard: Shard | ExpertShard, shape: list[int], fused_gate_up: bool) -> list[Index]:
    """The index tuples of the checkpoint tensor (of `shape`) this rank holds, concatenated
    along the split dim in order; for a fused gate_up_proj [E, 2I, H] the gate and up rows."""
    full = [slice(0, n) for n in shape]
    if isinstance(shard, ExpertShard):
        full[0] = slice(shard.first, shard.first + shard.count)
        inner = shard.inner
    else:
        inner = shard
    dim = inner.dim % len(shape)
    if fused_gate_up and dim == len(shape) - 2:
        half = shape[dim] // 2
        pieces = []
        for offset in (0, half):
            start, stop, _ = inner.bounds(half)
            piece = list(full)
            piece[dim] = slice(offset + start, offset + stop)
            pieces.append(tuple(piece))
        return pieces
    start, stop, _ = inner.bounds(shape[dim])
    full[dim] = slice(start, stop)
    return [tuple(full)]


def read_piece(
    handle: Any, name: str, index: Index, read_scale: ReadScale | None, block: tuple[int, int]
) -> torch.Tensor:
    """tensor[index]; with `read_scale` (FP8), dequantised over the covering blocks."""
    view = handle.get_slice(name)
    if read_scale is None:
        return view[index]
    rows, cols = block
    *lead, row_part, col_part = index
    out_dim, in_dim = view.get_shape()[-2:]
    row_blocks = slice(row_part.start // rows, -(-row_part.stop // rows))
    col_blocks = slice(col_part.start // cols, -(-col_part.stop // cols))
    covering = (*lead, slice(row_blocks.start * rows, min(row_blocks.stop * rows, out_dim)),
                slice(col_blocks.start * cols, min(col_blocks.stop * cols, in_dim)))  # fmt: skip
    weight = view[covering]
    scale = read_scale((*lead, row_blocks, col_blocks))
    w = dequantize_block_fp8(weight, scale, block)
    r0, c0 = row_part.start - covering[-2].start, col_part.start - covering[-1].start
    rows_n, cols_n = row_part.stop - row_part.start, col_part.stop - col_part.start
    return w[..., r0 : r0 + rows_n, c0 : c0 + cols_n]


def pad_to(tensor: torch.Tensor, shard: Shard | ExpertShard, local_shape: tuple[int, ...]):
    """Zero-pad the short last part of a padded (vocab) shard to the local shape."""
    if tuple(tensor.shape) == tuple(local_shape) or not isinstance(shard, Shard):
        return tensor
    dim = shard.dim % tensor.dim()
    missing = local_shape[dim] - tensor.shape[dim]
    if not shard.padded or missing < 0:
        return tensor
    pad = [0, 0] * (tensor.dim() - 1 - dim) + [0, missing]
    return F.pad(tensor, pad)
