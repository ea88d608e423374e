"""Block-FP8 weights kept FP8: a Linear holding the checkpoint's e4m3 weight and 128x128 scales.

On CUDA (or with `--fp8-gemm-backend triton` anywhere Triton runs) the quantised Linears of a
block-FP8 checkpoint (fp8.QUANTIZED_WEIGHT_RE) are swapped for `Fp8Linear` before loading, so the
loader copies `W8` and `W8_scale_inv` as they are (half the bytes of bf16) and every forward is the
`fp8_gemm` op. `kv_b_proj` stays dequantised (the absorbed form reads its weight as W_UK / W_UV,
as SGLang's w_kc / w_vc); the routed experts are kept FP8 separately, by the `moe` op's backend
(layers/fp8_experts.py).

Under tensor parallelism a column-parallel Linear keeps its rows of `W8` and of the scale grid, a
row-parallel one its columns (and its all-reduce, and its bias on part 0): both carry the same
`Shard` so the loader reads only this rank's blocks. That is exact only where the slice starts
and ends on 128-block boundaries; a Linear whose slice does not stays a float Linear (dequantised
on load) and is named in one warning.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn

from dsaserve.kernels.block_fp8 import FP8_DTYPE, KEPT_BLOCK, QUANTIZED_WEIGHT_RE, scale_shape

logger = logging.getLogger(__name__)


class Fp8Linear(nn.Module):
    def __init__(self, linear: nn.Linear, gemm: Callable) -> None:
        super().__init__()
        out_dim, in_dim = linear.weight.shape
        device = linear.weight.device
        self.in_features, self.out_features = in_dim, out_dim
        self.weight = nn.Parameter(torch.empty(out_dim, in_dim, dtype=FP8_DTYPE, device=device),
                                   requires_grad=False)  # fmt: skip
        scale = torch.empty(scale_shape((out_dim, in_dim)), dtype=torch.float32, device=device)
        self.weight_scale_inv = nn.Parameter(scale, requires_grad=False)
        shard = getattr(linear.weight, "shard", None)
        if shard is not None:  # this rank's rows / columns: the same blocks of the scale grid
            self.weight.shard = self.weight_scale_inv.shard = shard  # type: ignore[attr-defined]
        self.bias = linear.bias
        self.part_index = getattr(linear, "part_index", 0)  # row-parallel: bias on part 0
        self.reduce = getattr(linear, "reduce", None)  # row-parallel: the partials' sum
        self.gemm = gemm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias if self.part_index == 0 else None
        y = self.gemm(x, self.weight, self.weight_scale_inv, bias)
        return self.reduce(y) if self.reduce is not None else y


def block_aligned(linear: nn.Linear) -> bool:
    """Whole, or this rank's slice of the split dim starts and ends on a 128-block boundary."""
    shard = getattr(linear.weight, "shard", None)
    return shard is None or linear.weight.shape[shard.dim % 2] % KEPT_BLOCK == 0


def keep_fp8(model: nn.Module, gemm: Callable) -> int:
    """Swap every quantised nn.Linear of `model` whose slice is block-aligned for an Fp8Linear;
    returns how many (the others are dequantised on load, named in one warning)."""
    swapped, unaligned = 0, []
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            full = f"{name}.{child_name}" if name else child_name
            quantised = QUANTIZED_WEIGHT_RE.search(f".{full}.weight") is not None
            if not isinstance(child, nn.Linear) or not quantised or child_name == "kv_b_proj":
                continue
            if not block_aligned(child):
                unaligned.append(f"{full}.weight")
                continue
            setattr(module, child_name, Fp8Linear(child, gemm))
            swapped += 1
    if unaligned:
        logger.warning("dequantised on load (this rank's slice is not on %d-blocks): %s",
                       KEPT_BLOCK, ", ".join(unaligned))  # fmt: skip
    return swapped
