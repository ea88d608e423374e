"""Fill a model from a Hugging Face safetensors checkpoint folder, streaming shard by shard.

The model's parameter and persistent-buffer names are the checkpoint's (transformers 5 names),
so loading is a lookup. Two translations happen on the way:

- per-expert tensors `...mlp.experts.{e}.{gate,up,down}_proj.weight` are written into the
  fused `...mlp.experts.gate_up_proj` [E, 2I, H] (gate rows, then up) and `down_proj` [E, H, I];
  a fused checkpoint is taken as is;
- block-FP8 tensors (with a sibling `<name>_scale_inv`) are dequantised on CPU, unless the
  model holds that tensor FP8 (layers/fp8_linear.py, layers/fp8_experts.py): then the bytes
  and the scales are copied as stored (per-expert scales into the fused `*_scale_inv` grid),
  under tensor / expert parallelism only this rank's slice of each (the scale parameter carries
  the weight's shard, so its pieces are the blocks covering the weight's).

Router weights (`mlp.gate.weight`, `e_score_correction_bias`) stay float32; all else is cast to
the requested dtype. Tensors the model lacks (e.g. an MTP layer it skips) are ignored.
"""

from __future__ import annotations

import logging
import re
import time
from contextlib import nullcontext
from pathlib import Path

import torch
from torch import nn
from tqdm.auto import tqdm

from dsaserve.kernels.block_fp8 import SCALE_SUFFIX, dequantize_block_fp8
from dsaserve.kernels.nvfp4 import SCALE, SCALE_2
from dsaserve.models.checkpoint_files import (
    CheckpointError,
    find_checkpoint_files,
    fp8_block_size,
    get_tensor,
    open_safetensors,
    tensor_locations,
)
from dsaserve.models.checkpoint_slices import Index, pad_to, read_piece, shard_pieces
from dsaserve.models.load_targets import (
    FP8_DTYPES,
    Target,
    check_shape,
    collect_targets,
    held_bytes,
    missing_name,
    storage,
)
from dsaserve.models.nvfp4 import companion_of, is_nvfp4_weight, read_nvfp4

__all__ = ["CheckpointError", "load_checkpoint"]

logger = logging.getLogger(__name__)

EXPERT_RE = re.compile(
    r"^(?P<prefix>.+\.mlp\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$"
)


def load_checkpoint(
    model: nn.Module, path: str | Path, dtype: torch.dtype, *, show_progress: bool = True
) -> None:
    """Fill every parameter and persistent buffer of `model` from the checkpoint folder."""
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise CheckpointError(f"load dtype must be a floating torch.dtype, got {dtype!r}")
    folder = Path(path)
    files = find_checkpoint_files(folder)
    on_disk = sum(file.stat().st_size for file in files)
    logger.info("loading weights from %s: %d file(s), %d bytes", folder, len(files), on_disk)
    start = time.monotonic()
    targets = collect_targets(model, dtype)
    loader = _Loader(targets, tensor_locations(files), fp8_block_size(folder))
    with (
        torch.no_grad(),
        tqdm(
            total=len(loader.locations),
            desc=f"Loading {folder.name}",
            unit="tensor",
            disable=not show_progress,
        ) as bar,
    ):
        for file in files:
            with open_safetensors(file) as handle:
                for name in handle.keys():
                    loader.load(name, handle, file)
                    bar.update()
    loader.check_complete(folder)
    logger.info("loaded weights from %s (%d bytes on disk): %d bytes held, in %.1f s", folder,
                on_disk, held_bytes(model, dtype), time.monotonic() - start)  # fmt: skip


class _Loader:
    """Places each checkpoint tensor into its model target; tracks what is still missing."""

    def __init__(
        self, targets: dict[str, Target], locations: dict[str, Path], block: tuple[int, int]
    ) -> None:
        self.targets = targets
        self.locations = locations
        self.block = block
        self.ignored: list[str] = []

    def load(self, name: str, handle: object, file: Path) -> None:
        if name.endswith(SCALE_SUFFIX) and name[: -len(SCALE_SUFFIX)] in self.locations:
            if name not in self.targets:  # an FP8 weight kept FP8 loads its scale as is
                return  # read together with its weight
        if companion_of(name, self.locations) is not None:
            return  # an NVFP4 scale, read together with its weight
        target = self.targets.get(name)
        expert = EXPERT_RE.match(name) if target is None else None
        fused = self._fused_target(expert) if expert else None
        if target is None and fused is None:
            self.ignored.append(name)
            logger.debug("ignoring checkpoint tensor %s (not in the model)", name)
            return
        if fused is not None and not self._holds_expert(fused, int(expert["expert"])):
            return  # another rank's expert (expert parallel): not read at all
        # Why: dequantising on the target's device (a GPU when there is one) is much faster.
        device = (target or fused).tensor.device
        device = device if device.type != "meta" else None
        raw = target is not None and target.dtype in FP8_DTYPES  # kept FP8 (layers/fp8_linear)
        if target is not None:
            tensor = self._read_target(name, handle, file, device, target, raw)
            self._place_whole(name, target, tensor)
        elif fused.dtype in FP8_DTYPES:  # experts kept FP8 (layers/fp8_experts)
            self._place_fp8_expert(name, handle, file, expert, fused)
        elif fused.dtype == torch.uint8:  # experts kept NVFP4 (layers/nvfp4_experts)
            self._place_nvfp4_expert(name, handle, file, expert, fused)
        else:
            pieces = self._expert_pieces(handle, name, fused, expert)
            tensor = torch.cat([self._read(name, handle, file, device, p) for p in pieces], 0)
            self._place_expert(name, expert, fused, tensor)

    def _place_fp8_expert(self, name, handle, file: Path, expert, target: Target) -> None:
        """This rank's rows / columns of one expert's e4m3 weight and the matching blocks of
        its scale, as stored, into the fused tensors (layers/fp8_experts.py)."""
        scale_name = name + SCALE_SUFFIX
        dtype = handle.get_slice(name).get_dtype()
        if dtype not in ("F8_E4M3", "F8_E5M2") or scale_name not in self.locations:
            stored = scale_name in self.locations
            raise CheckpointError(
                f"expert tensor {name} in {file} is not block-FP8 ({dtype}, "
                f"{scale_name} stored: {stored}); the model keeps it FP8"
            )
        (piece,) = self._expert_pieces(handle, name, target, expert)
        self._place_expert(name, expert, target, self._read(name, handle, file, None, piece, True))
        scales = self.targets[target.names[0] + SCALE_SUFFIX]
        where = self.locations[scale_name]
        with open_safetensors(where) if where != file else nullcontext(handle) as other:
            (piece,) = self._expert_pieces(other, scale_name, scales, expert)
            scale = self._read(scale_name, other, where, None, piece, True)
        self._place_expert(scale_name, expert, scales, scale)

    def _place_nvfp4_expert(self, name, handle, file: Path, expert, target: Target) -> None:
        """One expert's e2m1 codes, e4m3 scales and global scale (a scalar, given to each of
        its rows), as stored, into the fused tensors (layers/nvfp4_experts.py)."""
        if handle.get_slice(name).get_dtype() != "U8" or name + SCALE not in self.locations:
            raise CheckpointError(f"expert tensor {name} in {file} is not NVFP4; the model "
                                  "keeps it NVFP4")  # fmt: skip
        self._place_expert(name, expert, target, get_tensor(handle, name, file))
        for suffix in (SCALE, SCALE_2):
            part = self._sibling(name + suffix, handle, file)
            scales = self.targets[target.names[0] + suffix]
            if suffix == SCALE_2:  # the expert's one global scale, on each of its rows
                rows = target.tensor.shape[1] // (1 if expert["proj"] == "down_proj" else 2)
                part = part.float().reshape(1, 1).expand(rows, 1)
            self._place_expert(name + suffix, expert, scales, part)

    def _read_target(self, name, handle, file, device, target: Target, raw: bool) -> torch.Tensor:
        """The target's slice (all of it without a shard), zero-padded to the local shape."""
        if target.shard is None:
            return self._read(name, handle, file, device, raw=raw)
        shape = list(handle.get_slice(name).get_shape())
        fused_gate_up = name.endswith((".gate_up_proj", ".gate_up_proj" + SCALE_SUFFIX))
        pieces = shard_pieces(target.shard, shape, fused_gate_up)
        dim = (len(shape) - 2) if fused_gate_up else target.shard_dim(len(shape))
        parts = [self._read(name, handle, file, device, piece, raw) for piece in pieces]
        return pad_to(torch.cat(parts, dim), target.shard, tuple(target.tensor.shape))

    @staticmethod
    def _holds_expert(target: Target, index: int) -> bool:
        shard = target.shard
        return shard is None or shard.first <= index < shard.first + shard.count

    @staticmethod
    def _expert_pieces(handle, name: str, target: Target, expert: re.Match[str]) -> list:
        """Index tuples of one per-expert tensor [rows, cols] that this rank holds."""
        shape = list(handle.get_slice(name).get_shape())
        if target.shard is None:
            return [None]
        inner = target.shard.inner
        inner = type(inner)(inner.dim % 2 if expert["proj"] == "down_proj" else 0,
                            inner.index, inner.parts)  # fmt: skip
        return shard_pieces(inner, shape, fused_gate_up=False)

    def _read(
        self, name: str, handle: object, file: Path, device: torch.device | None,
        piece: Index | None = None, raw: bool = False,
    ) -> torch.Tensor:  # fmt: skip
        if piece is not None:  # raw: as stored (an FP8 slice kept FP8, on whole blocks)
            view = handle.get_slice(name)
            return view[piece] if raw else self._read_piece(name, handle, file, device, piece)
        tensor = get_tensor(handle, name, file)
        if raw:
            return tensor
        if is_nvfp4_weight(name, tensor, self.locations):
            return read_nvfp4(name, tensor.to(device), lambda n: self._sibling(n, handle, file))
        if tensor.dtype not in FP8_DTYPES:
            return tensor
        scale_name = name + SCALE_SUFFIX
        scale_file = self.locations.get(scale_name)
        if scale_file is None:
            raise CheckpointError(f"FP8 tensor {name} in {file} has no {scale_name}")
        if scale_file == file:
            scale = get_tensor(handle, scale_name, file)
        else:
            with open_safetensors(scale_file) as other:
                scale = get_tensor(other, scale_name, scale_file)
        try:
            return dequantize_block_fp8(tensor.to(device), scale.to(device), self.block)
        except ValueError as exc:
            raise CheckpointError(f"FP8 tensor {name} in {file}: {exc}") from None

    def _sibling(self, name: str, handle: object, file: Path) -> torch.Tensor:
        where = self.locations[name]
        if where == file:
            return get_tensor(handle, name, file)
        with open_safetensors(where) as other:
            return get_tensor(other, name, where)

    def _read_piece(self, name, handle, file: Path, device, piece: Index) -> torch.Tensor:
        """tensor[piece]: only that slice is read (block-FP8: its covering blocks and scales)."""
        scale_name = name + SCALE_SUFFIX
        scale_file = self.locations.get(scale_name)
        if handle.get_slice(name).get_dtype() not in ("F8_E4M3", "F8_E5M2"):
            return handle.get_slice(name)[piece]
        if scale_file is None:
            raise CheckpointError(f"FP8 tensor {name} in {file} has no {scale_name}")

        def read_scale(index: Index) -> torch.Tensor:
            if scale_file == file:
                return handle.get_slice(scale_name)[index].to(device)
            with open_safetensors(scale_file) as other:
                return other.get_slice(scale_name)[index].to(device)

        try:
            return read_piece(handle, name, piece, read_scale, self.block)
        except ValueError as exc:
            raise CheckpointError(f"FP8 tensor {name} in {file}: {exc}") from None

    def _fused_target(self, expert: re.Match[str]) -> Target | None:
        kind = "down_proj" if expert["proj"] == "down_proj" else "gate_up_proj"
        target = self.targets.get(f"{expert['prefix']}.{kind}")
        return target if target is not None and target.tensor.dim() == 3 else None

    def _place_whole(self, name: str, target: Target, tensor: torch.Tensor) -> None:
        check_shape(name, tuple(target.tensor.shape), tuple(tensor.shape))
        storage(target).copy_(tensor)
        target.filled = True

    def _place_expert(
        self, name: str, expert: re.Match[str], target: Target, tensor: torch.Tensor
    ) -> None:
        num_experts, rows, cols = target.tensor.shape
        index, proj = int(expert["expert"]), expert["proj"]
        index -= target.shard.first if target.shard is not None else 0
        if index >= num_experts:
            raise CheckpointError(
                f"checkpoint tensor {name}: expert {index} is out of range, the model has "
                f"{num_experts} experts in {target.names[0]}"
            )
        half = rows // 2  # gate_up_proj rows: gate first, then up
        row_slice = {"gate_proj": slice(0, half), "up_proj": slice(half, rows)}.get(
            proj, slice(0, rows)
        )
        check_shape(name, (row_slice.stop - row_slice.start, cols), tuple(tensor.shape))
        storage(target)[index, row_slice].copy_(tensor)
        target.pieces.add((index, proj))

    def check_complete(self, folder: Path) -> None:
        missing = []
        for target in {id(t): t for t in self.targets.values()}.values():
            name = missing_name(target)
            if name is not None:
                missing.append(name)
        if missing:
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            raise CheckpointError(f"checkpoint {folder} has no tensor {missing[0]}{more}")
        if self.ignored:
            logger.info("ignored %d checkpoint tensors the model does not use", len(self.ignored))
