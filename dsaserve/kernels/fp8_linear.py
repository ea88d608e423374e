"""Block-FP8 weights kept FP8: a Linear holding the checkpoint's e4m3 weight and 128x128 scales.

On CUDA (or with `--fp8-gemm-backend triton` anywhere Triton runs) the quantised Linears of a
block-FP8 checkpoint (fp8.QUANTIZED_WEIGHT_RE) are swapped for `Fp8Linear` before loading, so the
loader copies `W8` and `W8_scale_inv` as they are (half the bytes of bf16) and every forward is the
`fp8_gemm` op. `kv_b_proj` stays dequantised (the absorbed form reads its weight as W_UK / W_UV,
as SGLang's w_kc / w_vc); the routed experts are kept FP8 separately, by the `moe` op's backend
(kernels/fp8_experts.py).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from dsaserve.models.fp8 import FP8_DTYPE, QUANTIZED_WEIGHT_RE, scale_shape


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
        self.bias = linear.bias
        self.gemm = gemm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gemm(x, self.weight, self.weight_scale_inv, self.bias)


def keep_fp8(model: nn.Module, gemm: Callable) -> int:
    """Swap every quantised nn.Linear of `model` for an Fp8Linear; returns how many."""
    swapped = 0
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            full = f"{name}.{child_name}" if name else child_name
            quantised = QUANTIZED_WEIGHT_RE.search(f".{full}.weight") is not None
            if isinstance(child, nn.Linear) and quantised and child_name != "kv_b_proj":
                setattr(module, child_name, Fp8Linear(child, gemm))
                swapped += 1
    return swapped
