"""Block-FP8 checkpoints: split fused experts, and convert a checkpoint folder to block FP8.

The format and its math (dequantise, quantise, which weights are quantised) are
kernels/block_fp8.py's.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from dsaserve.kernels.block_fp8 import (
    QUANTIZED_WEIGHT_RE,
    SCALE_SUFFIX,
    Block,
    block_pair,
    quantize_block_fp8,
)
from dsaserve.models.checkpoint_files import (
    CONFIG_NAME,
    INDEX_NAME,
    CheckpointError,
    find_checkpoint_files,
    get_tensor,
    open_safetensors,
    read_config,
)

FUSED_EXPERTS_RE = re.compile(r"^(?P<prefix>.+\.mlp\.experts)\.(?P<kind>gate_up_proj|down_proj)$")


def split_fused_experts(name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor] | None:
    """Per-expert `{prefix}.{e}.{gate,up,down}_proj.weight` tensors of a fused expert tensor."""
    match = FUSED_EXPERTS_RE.match(name)
    if match is None or tensor.dim() != 3:
        return None
    prefix = match["prefix"]
    if match["kind"] == "down_proj":  # [E, H, I]
        return {f"{prefix}.{e}.down_proj.weight": t for e, t in enumerate(tensor)}
    inter = tensor.shape[1] // 2  # [E, 2I, H]: gate rows first, then up
    pieces = {}
    for e, t in enumerate(tensor):
        pieces[f"{prefix}.{e}.gate_proj.weight"] = t[:inter]
        pieces[f"{prefix}.{e}.up_proj.weight"] = t[inter:]
    return pieces


def _convert_tensor(name: str, tensor: torch.Tensor, block: Block) -> dict[str, torch.Tensor]:
    if tensor.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise CheckpointError(f"tensor {name} is already FP8; the source must be bf16/fp16/fp32")
    pieces = split_fused_experts(name, tensor) or {name: tensor}
    out: dict[str, torch.Tensor] = {}
    for piece_name, piece in pieces.items():
        if QUANTIZED_WEIGHT_RE.search(piece_name) and piece.dim() == 2:
            out[piece_name], out[piece_name + SCALE_SUFFIX] = quantize_block_fp8(piece, block)
        else:
            out[piece_name] = piece.contiguous()
    return out


def _quantization_config(block: Block) -> dict[str, object]:
    return {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": list(block_pair(block)),
    }


def _write_config(src: Path, dst: Path, block: Block) -> None:
    config = read_config(src)
    if config is None:
        return
    if config.get("quantization_config"):
        raise CheckpointError(f"{src / CONFIG_NAME} already has a quantization_config")
    config["quantization_config"] = _quantization_config(block)
    (dst / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")


def _copy_other_files(src: Path, dst: Path) -> None:
    for item in src.iterdir():
        if item.suffix == ".safetensors" or item.name in (INDEX_NAME, CONFIG_NAME):
            continue
        if item.is_dir():
            shutil.copytree(item, dst / item.name, dirs_exist_ok=True)
        else:
            shutil.copy2(item, dst / item.name)


def _convert_file(file: Path, dst: Path, block: Block) -> dict[str, torch.Tensor]:
    converted: dict[str, torch.Tensor] = {}
    with open_safetensors(file) as handle:
        for name in handle.keys():
            converted.update(_convert_tensor(name, get_tensor(handle, name, file), block))
    save_file(converted, str(dst / file.name), metadata={"format": "pt"})
    return converted


def quantize_checkpoint(src_dir: str | Path, dst_dir: str | Path, block: Block = 128) -> None:
    """Write a DeepSeek-style block-FP8 copy of the bf16/fp32 checkpoint in `src_dir`.

    Shard by shard (same shard names, new index); fused experts are split per expert.
    """
    src, dst = Path(src_dir), Path(dst_dir)
    files = find_checkpoint_files(src)
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise CheckpointError(f"output folder {dst} exists and is not empty")
    dst.mkdir(parents=True, exist_ok=True)
    _write_config(src, dst, block)
    weight_map: dict[str, str] = {}
    total_size = 0
    for file in files:
        for name, tensor in _convert_file(file, dst, block).items():
            weight_map[name] = file.name
            total_size += tensor.numel() * tensor.element_size()
    if (src / INDEX_NAME).is_file():
        weight_map = dict(sorted(weight_map.items()))
        index = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
        (dst / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    _copy_other_files(src, dst)
