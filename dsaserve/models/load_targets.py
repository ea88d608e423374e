"""The model side of checkpoint loading: every tensor to fill (by each of its names), its storage
dtype, and which ones are still missing at the end (dsaserve/models/loader.py fills them)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from dsaserve.kernels.block_fp8 import SCALE_SUFFIX
from dsaserve.models.checkpoint_files import CheckpointError
from dsaserve.models.fp8 import FUSED_EXPERTS_RE

FP32_SUFFIXES = (".mlp.gate.weight", ".mlp.gate.e_score_correction_bias", "_proj_scale_2")
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


@dataclass
class Target:
    """One model tensor (with all the names it is reachable by) and what has been written."""

    names: list[str]
    owners: list[tuple[nn.Module, str]]
    tensor: torch.Tensor
    dtype: torch.dtype
    filled: bool = False
    pieces: set[tuple[int, str]] = field(default_factory=set)
    shard: object = None  # a layers/linear.py Shard / ExpertShard: this rank's slice

    def shard_dim(self, ndim: int) -> int:
        """The checkpoint dim the shard splits (pieces are joined along it)."""
        shard = self.shard
        return (shard.inner.dim if hasattr(shard, "inner") else shard.dim) % ndim


def collect_targets(model: nn.Module, dtype: torch.dtype) -> dict[str, Target]:
    """Every parameter and persistent buffer by each of its names (tied tensors share one)."""
    by_identity: dict[int, Target] = {}
    by_name: dict[str, Target] = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        persistent = {
            attr: buf
            for attr, buf in module._buffers.items()
            if buf is not None and attr not in module._non_persistent_buffers_set
        }
        params = {attr: p for attr, p in module._parameters.items() if p is not None}
        for attr, tensor in {**params, **persistent}.items():
            name = f"{prefix}.{attr}" if prefix else attr
            target = by_identity.get(id(tensor))
            if target is None:
                target = Target([], [], tensor, dtype, shard=getattr(tensor, "shard", None))
                by_identity[id(tensor)] = target
            target.names.append(name)
            target.owners.append((module, attr))
            if name.endswith(FP32_SUFFIXES) or name.endswith(SCALE_SUFFIX):
                target.dtype = torch.float32
            if tensor.dtype in (*FP8_DTYPES, torch.uint8):  # kept FP8, or NVFP4 codes
                target.dtype = tensor.dtype
            by_name[name] = target
    return by_name


def held_bytes(model: nn.Module, dtype: torch.dtype) -> int:
    """Bytes the loader leaves `model` holding (each tensor once, in the dtype it will be kept
    in: FP8 where kept, float32 for the router and scales, else `dtype`). Works on a meta model,
    so the fit check at start (runtime/memory_fit.py) and the load's log use the same count."""
    unique = {id(t): t for t in collect_targets(model, dtype).values()}
    return sum(t.tensor.numel() * t.dtype.itemsize for t in unique.values())


def storage(target: Target) -> torch.Tensor:
    """The target's tensor, first reallocated (same device) if meta or of another dtype."""
    current = target.tensor
    if not current.is_meta and current.dtype == target.dtype:
        return current
    device = torch.device("cpu") if current.is_meta else current.device
    fresh = torch.empty(current.shape, dtype=target.dtype, device=device)
    if isinstance(current, nn.Parameter):
        fresh = nn.Parameter(fresh, requires_grad=current.requires_grad)
    for module, attr in target.owners:
        if isinstance(fresh, nn.Parameter):
            module._parameters[attr] = fresh
        else:
            module._buffers[attr] = fresh
    target.tensor = fresh
    return fresh


def check_shape(name: str, expected: tuple[int, ...], found: tuple[int, ...]) -> None:
    if expected != found:
        raise CheckpointError(
            f"shape mismatch for {name}: the model expects {list(expected)}, "
            f"the checkpoint has {list(found)}"
        )


def missing_name(target: Target) -> str | None:
    """A name to report if `target` was not (fully) written, else None."""
    if target.filled:
        return None
    scales = (SCALE_SUFFIX, "_scale", "_scale_2")  # FP8 experts' scales, NVFP4 experts' ones
    suffix = next((s for s in scales if target.names[0].endswith(s)), "")
    fused = FUSED_EXPERTS_RE.match(target.names[0].removesuffix(suffix))
    fused = fused or next((m for m in map(FUSED_EXPERTS_RE.match, target.names) if m), None)
    if fused is None or target.tensor.dim() != 3:
        return target.names[0]
    projs = ("down_proj",) if fused["kind"] == "down_proj" else ("gate_proj", "up_proj")
    if not target.pieces:
        per_expert = "/".join(projs)
        each = f"{fused['prefix']}.{{e}}.{per_expert}.weight{suffix}"
        return f"{fused[0]}{suffix} (nor per-expert {each})"
    for index in range(target.tensor.shape[0]):
        for proj in projs:
            if (index, proj) not in target.pieces:
                return f"{fused['prefix']}.{index}.{proj}.weight{suffix}"
    return None
