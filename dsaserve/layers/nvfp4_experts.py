"""Routed experts kept NVFP4 at load: the checkpoint's e2m1 codes, per-16 e4m3 scales and global
scales, fused per layer, as stored (kernels/nvfp4.py has the format).

On CPU, one rank, the `moe` op's `cpu` backend keeps an NVFP4 checkpoint's routed experts so
(models/fp8_keep.py): the loader copies each expert's packed `gate_proj` / `up_proj` /
`down_proj` codes and their `weight_scale` bytes into

- `gate_up_proj` [E, 2I, H/2] uint8 (gate rows, then up) with `gate_up_proj_scale`
  [E, 2I, H/16] e4m3 and `gate_up_proj_scale_2` [E, 2I, 1] fp32 (each row's global scale: gate
  and up have their own), and
- `down_proj` [E, H, I/2] with `down_proj_scale` [E, H, I/16] and `down_proj_scale_2` [E, H, 1],

half a byte a weight and one e4m3 byte per 16 (the checkpoint's bytes, plus 4 per row). The
native decode reads them as stored (kernels/cpu_decode_math.h); the layered path dequantises
one busy expert at a time (kernels/cpu_fp8.py). W = e2m1 * (float(scale) * scale_2), the
loader's dequantisation, in both.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from dsaserve.kernels.nvfp4 import GROUP
from dsaserve.layers.moe import Experts, MoE


class Nvfp4Experts(nn.Module):
    """The routed experts of one MoE layer as fused NVFP4 tensors (names as `Experts`)."""

    def __init__(self, experts: Experts, moe: Callable) -> None:
        super().__init__()
        self.num_experts, self.first = experts.num_experts, experts.first
        for name in ("gate_up_proj", "down_proj"):
            count, rows, cols = getattr(experts, name).shape
            device = getattr(experts, name).device
            tensors = {name: ((count, rows, cols // 2), torch.uint8),
                       f"{name}_scale": ((count, rows, cols // GROUP), torch.float8_e4m3fn),
                       f"{name}_scale_2": ((count, rows, 1), torch.float32)}  # fmt: skip
            for attr, (shape, dtype) in tensors.items():
                empty = torch.empty(shape, dtype=dtype, device=device)
                setattr(self, attr, nn.Parameter(empty, requires_grad=False))
        self.moe = moe

    def forward(self, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return self.moe(self, x, index, weights)


def keep_nvfp4_experts(model: nn.Module, moe: Callable) -> None:
    """Swap every whole (one-rank) MoE layer's `Experts` of `model` for `Nvfp4Experts` where
    its inputs come in whole groups of 16."""
    for module in model.modules():
        if not isinstance(module, MoE) or not isinstance(module.experts, Experts):
            continue
        experts = module.experts
        if getattr(experts.down_proj, "shard", None) is not None:
            continue  # a rank's slice: dequantised on load
        if experts.down_proj.shape[-1] % GROUP or experts.gate_up_proj.shape[-1] % GROUP:
            continue
        module.experts = Nvfp4Experts(experts, moe)
