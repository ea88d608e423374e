"""The checkpoint loader's errors: every bad checkpoint is refused with one error naming the file
or the tensor (the fixtures and tiny models are test_loader.py's)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import test_loader
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from test_loader import make_model

from dsaserve.models.fp8 import quantize_checkpoint
from dsaserve.models.loader import CheckpointError, load_checkpoint

# test_loader.py's fixtures: both glm and deepseek tiny models, saved fused
family, source, fused_dir = test_loader.family, test_loader.source, test_loader.fused_dir


def load_into_fresh(folder: Path, family: str) -> None:
    load_checkpoint(make_model(family, seed=10), folder, torch.float32, show_progress=False)


def rewrite(folder: Path, change) -> None:
    path = folder / "model.safetensors"
    with safe_open(str(path), "pt") as f:
        state = {n: f.get_tensor(n) for n in f.keys()}
    change(state)
    save_file(state, str(path))


def copy_checkpoint(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for item in src.iterdir():
        (dst / item.name).write_bytes(item.read_bytes())
    return dst


def test_missing_folder_and_no_safetensors(tmp_path) -> None:
    with pytest.raises(CheckpointError, match="does not exist"):
        load_into_fresh(tmp_path / "nowhere", "glm")
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match=r"no model\.safetensors"):
        load_into_fresh(tmp_path, "glm")


def test_malformed_index_and_missing_shard(family, fused_dir, tmp_path) -> None:
    folder = copy_checkpoint(fused_dir, tmp_path / "ckpt")
    index = folder / "model.safetensors.index.json"
    index.write_text("{not json")
    with pytest.raises(CheckpointError, match=r"malformed index .*index\.json"):
        load_into_fresh(folder, family)
    index.write_text(json.dumps({"metadata": {}}))
    with pytest.raises(CheckpointError, match="weight_map"):
        load_into_fresh(folder, family)
    index.write_text(json.dumps({"weight_map": {"lm_head.weight": "model-2.safetensors"}}))
    with pytest.raises(CheckpointError, match=r"model-2\.safetensors .* missing"):
        load_into_fresh(folder, family)


def test_corrupt_file_is_named(family, fused_dir, tmp_path) -> None:
    folder = copy_checkpoint(fused_dir, tmp_path / "ckpt")
    (folder / "model.safetensors").write_bytes(b"\x10\x00\x00\x00garbage")
    with pytest.raises(CheckpointError, match=r"cannot read .*model\.safetensors"):
        load_into_fresh(folder, family)


@pytest.mark.parametrize(
    "drop",
    ["model.layers.1.self_attn.indexer.k_norm.bias", "model.layers.1.mlp.experts.down_proj"],
)
def test_missing_tensor_is_named(family, fused_dir, tmp_path, drop) -> None:
    folder = copy_checkpoint(fused_dir, tmp_path / "ckpt")
    rewrite(folder, lambda state: state.pop(drop))
    with pytest.raises(CheckpointError, match=f"no tensor {drop}"):
        load_into_fresh(folder, family)


def test_missing_expert_is_named(family, source, tmp_path) -> None:
    folder = tmp_path / "ckpt"
    source[0].save_pretrained(folder)
    rewrite(folder, lambda state: state.pop("model.layers.1.mlp.experts.2.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"no tensor model\.layers\.1\.mlp\.experts\.2\.up"):
        load_into_fresh(folder, family)


def test_shape_mismatch_and_extra_tensor(family, fused_dir, tmp_path) -> None:
    folder = copy_checkpoint(fused_dir, tmp_path / "ckpt")
    name = "model.layers.0.self_attn.q_b_proj.weight"
    rewrite(
        folder,
        lambda state: state.update({"unknown.extra": torch.ones(3), name: torch.ones(64, 33)}),
    )
    with pytest.raises(
        CheckpointError, match=rf"{name}: the model expects \[64, 32\], .* \[64, 33\]"
    ):
        load_into_fresh(folder, family)
    rewrite(folder, lambda state: state.update({name: torch.ones(64, 32)}))
    load_into_fresh(folder, family)  # the unknown extra tensor is ignored


def test_fp8_without_scale_is_named(family, fused_dir, tmp_path) -> None:
    fp8_dir = tmp_path / "fp8"
    quantize_checkpoint(fused_dir, fp8_dir)
    name = "model.layers.0.self_attn.o_proj.weight"
    rewrite(fp8_dir, lambda state: state.update({name + "_scale_inv": torch.ones(3, 3)}))
    with pytest.raises(CheckpointError, match=rf"{name} .*scale shape \[3, 3\]"):
        load_into_fresh(fp8_dir, family)
    rewrite(fp8_dir, lambda state: state.pop(name + "_scale_inv"))
    with pytest.raises(CheckpointError, match=rf"FP8 tensor {name} .* has no {name}_scale_inv"):
        load_into_fresh(fp8_dir, family)
