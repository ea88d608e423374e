"""Routed experts kept block-FP8: the checkpoint's e4m3 expert weights and 128x128 scales, fused.

When the `moe` op consumes FP8 (`--moe-runner-backend triton`, or `auto` on CUDA) the engine swaps
every MoE layer's `Experts` for `Fp8Experts` before loading, so the loader copies each expert's
`gate_proj` / `up_proj` / `down_proj` bytes and their `weight_scale_inv` as stored into

- `gate_up_proj` [E, 2I, H] e4m3 with `gate_up_proj_scale_inv` [E, 2I/128, H/128] fp32 (gate
  rows, then up: the two scale grids stack because I is a multiple of 128), and
- `down_proj` [E, H, I] e4m3 with `down_proj_scale_inv` [E, H/128, I/128],

the layout kernels/triton_moe.py reads (half the bytes of bf16, a quarter of fp32). Every call
(the layered prefill and decode, the static decode a CUDA graph holds) is the `moe` op over
them: masked for decode-sized batches, contiguous above.

Under tensor parallelism each rank holds rows [r*I/tp, (r+1)*I/tp) of every expert's gate and up
and those columns of its down, with the same blocks of the scale grids (the scales carry the
weights' `ExpertShard`, so the loader reads only this rank's blocks); under expert parallelism
whole experts [first, first + E/ep), and the op sees routing indices made local (-1 for
another rank's: the layouts of kernels/triton_moe.py leave those out). Kept only where that is
exact: this rank's intermediate slice a multiple of 128 (else a slice or the gate / up seam
would cut a scale block); elsewhere the experts are dequantised on load.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn

from dsaserve.kernels.block_fp8 import FP8_DTYPE, KEPT_BLOCK, scale_shape
from dsaserve.layers.moe import Experts, MoE

logger = logging.getLogger(__name__)


class Fp8Experts(nn.Module):
    """The routed experts of one MoE layer as fused block-FP8 tensors (names as `Experts`)."""

    def __init__(self, experts: Experts, moe: Callable) -> None:
        super().__init__()
        self.num_experts, self.first = experts.num_experts, experts.first
        for name in ("gate_up_proj", "down_proj"):
            like = getattr(experts, name)
            weight = torch.empty(like.shape, dtype=FP8_DTYPE, device=like.device)
            scale = torch.empty(scale_shape(like.shape), dtype=torch.float32, device=like.device)
            setattr(self, name, nn.Parameter(weight, requires_grad=False))
            setattr(self, f"{name}_scale_inv", nn.Parameter(scale, requires_grad=False))
            shard = getattr(like, "shard", None)
            if shard is not None:  # this rank's experts and slice: the same blocks of the scales
                getattr(self, name).shard = shard
                getattr(self, f"{name}_scale_inv").shard = shard
        self.moe = moe

    def forward(self, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        count = self.gate_up_proj.shape[0]
        if count < self.num_experts:  # expert parallel: local ids, -1 for another rank's
            local = index - self.first
            mine = (local >= 0) & (local < count)
            index, weights = torch.where(mine, local, -1), weights * mine
        return self.moe(self, x, index, weights)


def keepable(experts: Experts) -> bool:
    """This rank's slice of every expert's intermediate size a multiple of the scale block."""
    return experts.down_proj.shape[-1] % KEPT_BLOCK == 0


def keep_fp8_experts(model: nn.Module, moe: Callable) -> int:
    """Swap every MoE layer's `Experts` of `model` for `Fp8Experts`; returns how many."""
    swapped = skipped = 0
    for module in model.modules():
        if not isinstance(module, MoE) or not isinstance(module.experts, Experts):
            continue
        if not keepable(module.experts):
            skipped += 1
            continue
        module.experts = Fp8Experts(module.experts, moe)
        swapped += 1
    if skipped:
        logger.warning("%d MoE layers' experts are dequantised on load (this rank's slice of "
                       "the expert intermediate size is not a multiple of %d)",
                       skipped, KEPT_BLOCK)  # fmt: skip
    return swapped


def expert_bytes(model: nn.Module) -> int:
    """Bytes of every MoE layer's routed-expert weights (and scales, when kept FP8)."""
    total = 0
    for module in model.modules():
        if isinstance(module, MoE):
            total += sum(p.numel() * p.element_size() for p in module.experts.parameters())
    return total
