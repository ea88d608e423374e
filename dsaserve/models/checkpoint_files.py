"""Finding and opening the safetensors files of a Hugging Face checkpoint folder.

Shared by the loader (`loader.py`) and the FP8 converter (`fp8.py`). Every failure here is a
`CheckpointError` with a one-line message that names the folder or file.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
CONFIG_NAME = "config.json"
DEFAULT_BLOCK = 128


class CheckpointError(ValueError):
    """A checkpoint folder, file or tensor is unusable; the message names which one."""


def find_checkpoint_files(folder: str | Path) -> list[Path]:
    """The safetensors files of `folder`: the index's shards, `model.safetensors`, or all."""
    folder = Path(folder)
    if not folder.exists():
        raise CheckpointError(f"checkpoint folder {folder} does not exist")
    if not folder.is_dir():
        raise CheckpointError(f"checkpoint path {folder} is not a folder")
    if (folder / INDEX_NAME).is_file():
        return index_shard_files(folder)
    if (folder / SINGLE_NAME).is_file():
        return [folder / SINGLE_NAME]
    # Why: some exports ship shards without an index; take them all, in name order.
    loose = sorted(folder.glob("*.safetensors"))
    if not loose:
        raise CheckpointError(
            f"no {SINGLE_NAME} or {INDEX_NAME} (nor any *.safetensors file) in {folder}"
        )
    return loose


def read_weight_map(folder: Path) -> dict[str, str]:
    """The validated `weight_map` (tensor name -> shard file name) of the folder's index."""
    index_path = folder / INDEX_NAME
    try:
        index = json.loads(index_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"malformed index {index_path}: {_one_line(exc)}") from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"malformed index {index_path}: no 'weight_map' object")
    for name, shard in weight_map.items():
        if not isinstance(shard, str) or "/" in shard or shard in ("", ".", ".."):
            raise CheckpointError(
                f"malformed index {index_path}: tensor {name} maps to {shard!r}, not a file name"
            )
    return weight_map


def index_shard_files(folder: Path) -> list[Path]:
    """The distinct shard files named by the index, each checked to exist."""
    shards = sorted(set(read_weight_map(folder).values()))
    for shard in shards:
        if not (folder / shard).is_file():
            raise CheckpointError(f"shard {folder / shard} named by {INDEX_NAME} is missing")
    return [folder / shard for shard in shards]


@contextmanager
def open_safetensors(file: Path) -> Iterator[Any]:
    """`safe_open(file)` on CPU whose open errors become a `CheckpointError` naming the file."""
    try:
        handle = safe_open(str(file), framework="pt", device="cpu")
    except Exception as exc:  # safetensors raises its own error types (and OSError)
        raise CheckpointError(f"cannot read {file}: {_one_line(exc)}") from None
    with handle as opened:
        yield opened


def get_tensor(handle: Any, name: str, file: Path) -> torch.Tensor:
    """One tensor of an open file; a read failure names the tensor and the file."""
    try:
        return handle.get_tensor(name)
    except Exception as exc:
        raise CheckpointError(f"cannot read tensor {name} from {file}: {_one_line(exc)}") from None


def tensor_locations(files: list[Path]) -> dict[str, Path]:
    """Map every tensor name to the file that holds it, reading only the file headers."""
    locations: dict[str, Path] = {}
    for file in files:
        with open_safetensors(file) as handle:
            for name in handle.keys():
                if name in locations:
                    raise CheckpointError(f"tensor {name} is in both {locations[name]} and {file}")
                locations[name] = file
    return locations


def read_config(folder: Path) -> dict[str, Any] | None:
    """The folder's `config.json` as a dict, or None when there is none."""
    path = folder / CONFIG_NAME
    if not path.is_file():
        return None
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"malformed {path}: {_one_line(exc)}") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"malformed {path}: not a JSON object")
    return config


def fp8_block_size(folder: Path) -> tuple[int, int]:
    """`quantization_config.weight_block_size` from config.json, default 128 x 128."""
    config = read_config(folder) or {}
    quant = config.get("quantization_config") or {}
    block = quant.get("weight_block_size") if isinstance(quant, dict) else None
    if block is None:
        return (DEFAULT_BLOCK, DEFAULT_BLOCK)
    valid = isinstance(block, list) and len(block) == 2
    if not valid or not all(isinstance(b, int) and b > 0 for b in block):
        raise CheckpointError(
            f"malformed {folder / CONFIG_NAME}: weight_block_size {block!r} is not [rows, cols]"
        )
    return (block[0], block[1])


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text or type(exc).__name__
