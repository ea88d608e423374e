"""Load a DFlash / DFlash2 drafter from a local folder, by the published safetensors names.

The names are the reference's (`fc.weight`, `layers.0.self_attn.q_proj.weight`, …,
`candidate_selector.predecessor_codebook`), so a published drafter loads unchanged. Names some
exports add are accepted too: a `.weight` suffix on the codebooks (transformers' key mapping
of the reference's `nn.Embedding`s), and copies of the target's `embed_tokens` / `lm_head` and
rotary buffers, which are skipped (the target's own are used). Anything else missing or extra,
or a shape that differs, is refused in one line naming the tensor.
"""

from __future__ import annotations

from pathlib import Path

import torch

from dsaserve.model_config import ModelConfig
from dsaserve.models.checkpoint_files import (
    CheckpointError,
    find_checkpoint_files,
    get_tensor,
    open_safetensors,
    tensor_locations,
)
from dsaserve.models.dflash import DFlashDraftModel
from dsaserve.models.dflash_config import DFlashConfig

SKIPPED = ("embed_tokens.weight", "lm_head.weight", "rotary_emb.inv_freq")
CODEBOOKS = ("candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook")


def load_drafter(path: str | Path, target: ModelConfig, dtype: torch.dtype,
                 device: torch.device | str = "cpu") -> DFlashDraftModel:  # fmt: skip
    """The drafter in `path`, checked to fit `target`, in `dtype` on `device`, eval mode."""
    config = DFlashConfig.from_dir(path)
    config.check_fits(target)
    with torch.device("meta"):
        model = DFlashDraftModel(config)
    params = dict(model.named_parameters())
    locations = {_canonical(name): (name, file)
                 for name, file in tensor_locations(find_checkpoint_files(path)).items()
                 if not name.endswith(SKIPPED)}  # fmt: skip
    missing = sorted(set(params) - set(locations))
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"drafter {path}: tensor {missing[0]} is missing{more}")
    extra = sorted(set(locations) - set(params))
    if extra:
        raise CheckpointError(f"drafter {path}: unexpected tensor {locations[extra[0]][0]} (not "
                              f"part of a {config.architecture} with this config)")  # fmt: skip
    state = {name: _read(locations[name], params[name].shape, dtype) for name in params}
    model.load_state_dict(state, assign=True)
    model.to(device).eval().requires_grad_(False)
    return model


def _canonical(name: str) -> str:
    for codebook in CODEBOOKS:
        if name == f"{codebook}.weight":
            return codebook
    return name


def _read(location: tuple[str, Path], shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    name, file = location
    with open_safetensors(file) as handle:
        tensor = get_tensor(handle, name, file)
    if tensor.shape != shape:
        raise CheckpointError(f"{file}: tensor {name} has shape {list(tensor.shape)}, the config "
                              f"needs {list(shape)}")  # fmt: skip
    return tensor.to(dtype)
