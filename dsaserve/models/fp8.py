"""Block FP8 (DeepSeek-V3 style): dequantise, quantise, and convert a checkpoint folder.

A quantised weight `W` [out, in] is stored as `W8` (float8_e4m3fn) and `scale_inv` (float32,
[ceil(out/128), ceil(in/128)]) with W = W8 * scale_inv broadcast over 128 x 128 blocks, edge
blocks partial. Leading batch dimensions (fused experts, [E, out, in]) are allowed throughout.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from dsaserve.models.checkpoint_files import (
    CONFIG_NAME,
    INDEX_NAME,
    CheckpointError,
    find_checkpoint_files,
    get_tensor,
    open_safetensors,
    read_config,
)

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn
SCALE_SUFFIX = "_scale_inv"
KEPT_BLOCK = 128  # the scale block the kernels that run FP8 weights as stored take (128 x 128)

# model.md section 6: the Linear weights that published FP8 checkpoints quantise. Norms, the
# router, embeddings, lm_head, indexer.weights_proj / k_norm and eh_proj stay unquantised.
QUANTIZED_WEIGHT_RE = re.compile(
    r"\.(self_attn\.(q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj|indexer\.wq_b"
    r"|indexer\.wk)|mlp\.(gate_proj|up_proj|down_proj)|mlp\.experts\.\d+\.(gate_proj|up_proj"
    r"|down_proj)|mlp\.shared_experts\.(gate_proj|up_proj|down_proj))\.weight$"
)
FUSED_EXPERTS_RE = re.compile(r"^(?P<prefix>.+\.mlp\.experts)\.(?P<kind>gate_up_proj|down_proj)$")

Block = int | tuple[int, int]


def _block_pair(block: Block) -> tuple[int, int]:
    pair = (block, block) if isinstance(block, int) else tuple(block)
    if len(pair) != 2 or not all(isinstance(b, int) and b > 0 for b in pair):
        raise ValueError(f"block must be a positive int or a pair of them, got {block!r}")
    return pair  # type: ignore[return-value]


def scale_shape(weight_shape: torch.Size | tuple[int, ...], block: Block = 128) -> tuple[int, ...]:
    """The `scale_inv` shape for a weight of `weight_shape`: last two dims ceil-divided."""
    rows, cols = _block_pair(block)
    *lead, out_dim, in_dim = weight_shape
    return (*lead, -(-out_dim // rows), -(-in_dim // cols))


def _pad_to_blocks(w: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    out_dim, in_dim = w.shape[-2:]
    return F.pad(w, (0, -in_dim % cols, 0, -out_dim % rows))


def _blocked(w: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """View a padded [..., out, in] tensor as [..., out/rows, rows, in/cols, cols]."""
    *lead, out_dim, in_dim = w.shape
    return w.reshape(*lead, out_dim // rows, rows, in_dim // cols, cols)


def dequantize_block_fp8(
    w8: torch.Tensor, scale_inv: torch.Tensor, block: Block = 128
) -> torch.Tensor:
    """W8 * scale_inv over blocks, as float32. Raises ValueError on mismatched shapes."""
    rows, cols = _block_pair(block)
    if w8.dim() < 2:
        raise ValueError(f"an FP8 weight needs at least 2 dims, got shape {list(w8.shape)}")
    expected = scale_shape(w8.shape, (rows, cols))
    if tuple(scale_inv.shape) != expected:
        raise ValueError(
            f"scale shape {list(scale_inv.shape)} does not fit weight shape {list(w8.shape)} "
            f"with {rows}x{cols} blocks (expected {list(expected)})"
        )
    out_dim, in_dim = w8.shape[-2:]
    padded = _blocked(_pad_to_blocks(w8.float(), rows, cols), rows, cols)
    w = padded * scale_inv.float()[..., :, None, :, None]  # [..., ob, rows, ib, cols]
    w = w.reshape(*w8.shape[:-2], padded.shape[-4] * rows, padded.shape[-2] * cols)
    return w[..., :out_dim, :in_dim].contiguous()


def quantize_block_fp8(w: torch.Tensor, block: Block = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """(W8, scale_inv) with scale_inv = amax / 448 per block (1.0 for an all-zero block)."""
    rows, cols = _block_pair(block)
    if w.dim() < 2 or not w.is_floating_point():
        raise ValueError(f"cannot quantize a {w.dtype} tensor of shape {list(w.shape)}")
    out_dim, in_dim = w.shape[-2:]
    padded = _blocked(_pad_to_blocks(w.float(), rows, cols), rows, cols)
    amax = padded.abs().amax(dim=(-3, -1))  # [..., ob, ib]
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    scaled = (padded / scale[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX)
    w8 = scaled.to(FP8_DTYPE).reshape(*w.shape[:-2], *_padded_dims(padded))
    return w8[..., :out_dim, :in_dim].contiguous(), scale.float().contiguous()


def _padded_dims(blocked: torch.Tensor) -> tuple[int, int]:
    return (blocked.shape[-4] * blocked.shape[-3], blocked.shape[-2] * blocked.shape[-1])


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
        "weight_block_size": list(_block_pair(block)),
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
