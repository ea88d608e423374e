"""Which block-FP8 weights a rank keeps FP8, and the per-rank report of what it holds.

Every rank (the leader's engine and each follower, both through engine/shard.py) calls
`keep_fp8_weights` on its meta model before loading, so each keeps its own slice FP8: quantised
Linears when the `fp8_gemm` op takes FP8 weights (layers/fp8_linear.py), routed experts when the
`moe` op does (layers/fp8_experts.py): every backend but `torch`, which dequantises on load (on CPU
`auto` is `cpu`, kernels/cpu_fp8.py: kept). After loading, `rank_reports` gathers from every rank
what it kept: counts, routed-expert bytes and, per kept tensor, its dtype, shape and a
position-weighted checksum of its bytes (engine stats `fp8_ranks`; the test compares it with the
checkpoint's block slices).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dsaserve.kernels.block_fp8 import KEPT_BLOCK, SCALE_SUFFIX
from dsaserve.layers.fp8_experts import expert_bytes, keep_fp8_experts
from dsaserve.layers.fp8_linear import keep_fp8
from dsaserve.layers.nvfp4_experts import keep_nvfp4_experts
from dsaserve.models.checkpoint_files import fp8_block_size
from dsaserve.models.load_targets import FP8_DTYPES
from dsaserve.models.nvfp4 import is_nvfp4_checkpoint

logger = logging.getLogger(__name__)

CHUNK = 1 << 24  # bytes summed at a time (bounds the int64 temporaries)
MODULUS = 65521


@dataclass
class KeptFp8:
    linears: int = 0
    expert_layers: int = 0


@dataclass
class RankReport:
    rank: int
    fp8_linears_kept: int
    fp8_expert_layers_kept: int
    routed_expert_bytes: int
    tensors: dict[str, tuple[str, list[int], int]] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        fields = ("rank", "fp8_linears_kept", "fp8_expert_layers_kept", "routed_expert_bytes")
        return {name: getattr(self, name) for name in fields}


def keep_fp8_weights(model: nn.Module, quantization: str | None, names: dict[str, str],
                     kernels: Any, model_path: str) -> KeptFp8:  # fmt: skip
    """Swap this rank's quantised Linears / routed experts for their FP8 forms (before load);
    an NVFP4 checkpoint's routed experts for their NVFP4 form where the `moe` op is the CPU one."""
    kept = KeptFp8()
    if names["moe"] == "cpu" and is_nvfp4_checkpoint(Path(model_path)):
        keep_nvfp4_experts(model, kernels.moe)
        return kept
    if quantization != "fp8" or names["fp8_gemm"] == names["moe"] == "torch":
        return kept
    if fp8_block_size(Path(model_path)) != (KEPT_BLOCK, KEPT_BLOCK):
        logger.warning("FP8 blocks are not 128x128: dequantising the weights on load")
        return kept
    if names["fp8_gemm"] != "torch":
        kept.linears = keep_fp8(model, kernels.fp8_gemm)
    if names["moe"] != "torch":
        kept.expert_layers = keep_fp8_experts(model, kernels.moe)
    return kept


def checksum(tensor: torch.Tensor) -> int:
    """sum_i (byte_i + 1) * (i mod 65521 + 1) over the tensor's bytes (row-major): a wrong slice,
    a shifted block or a dequantised copy gives another value."""
    flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    total = 0
    for start in range(0, flat.numel(), CHUNK):
        part = flat[start : start + CHUNK].long() + 1
        weight = torch.arange(start, start + part.numel(), device=part.device) % MODULUS + 1
        total += int((part * weight).sum())
    return total


def rank_report(model: nn.Module, rank: int, kept: KeptFp8) -> RankReport:
    """What this rank holds FP8 (every e4m3 parameter and its scale), after loading."""
    report = RankReport(rank, kept.linears, kept.expert_layers, expert_bytes(model))
    params = dict(model.named_parameters())
    for name, param in params.items():
        if param.dtype not in FP8_DTYPES:
            continue
        for held in (name, name + SCALE_SUFFIX):
            if held in params:
                tensor = params[held]
                shape = list(tensor.shape)
                report.tensors[held] = (str(tensor.dtype), shape, checksum(tensor))
    return report


def rank_reports(model: nn.Module, parallel: Any, kept: KeptFp8) -> list[RankReport]:
    """Every rank's report, in rank order (a collective: every rank calls it once, after load)."""
    mine = rank_report(model, parallel.rank, kept)
    if parallel.world == 1:
        return [mine]
    everyone: list[Any] = [None] * parallel.world
    torch.distributed.all_gather_object(everyone, mine, group=parallel.cpu_group)
    return everyone
