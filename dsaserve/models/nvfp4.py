"""NVFP4 (NVIDIA Model Optimizer): 4-bit e2m1 routed experts with two-level scales.

A quantised Linear `X.weight` [out, in] is stored as

- `X.weight` uint8 [out, in/2]: e2m1 codes, two per byte, element 2i in the low nibble;
- `X.weight_scale` float8_e4m3fn [out, in/16]: one scale per 16 consecutive inputs;
- `X.weight_scale_2` float32 scalar: the global scale, amax(W) / (6 * 448);
- `X.input_scale` float32 scalar: the activation's global scale (used by an FP4 GEMM, which
  quantises the activation too; the dequantised path keeps activations unquantised);

with W = e2m1(code) * float(weight_scale) * weight_scale_2. `hf_quant_config.json` (and
config.json's `quantization_config`, quant_method `modelopt`) say quant_algo NVFP4, group_size
16. Only the routed experts are quantised here (as in RadixArk/GLM-5.3-NVFP4); everything else
stays unquantised. The format's math is kernels/nvfp4.py's. On CPU, one rank, the routed experts
are kept NVFP4 (layers/nvfp4_experts.py); elsewhere they are dequantised on load (no FP4 GEMM).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from dsaserve.kernels.nvfp4 import (
    GROUP,
    SCALE,
    SCALE_2,
    dequantize_nvfp4,
    quantize_nvfp4,
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
from dsaserve.models.fp8 import split_fused_experts

QUANT_CONFIG_NAME = "hf_quant_config.json"
ROUTED_EXPERT_RE = re.compile(r"\.mlp\.experts\.\d+\.(gate_proj|up_proj|down_proj)\.weight$")


def is_nvfp4_checkpoint(folder: Path) -> bool:
    """config.json's `quantization_config` says ModelOpt NVFP4."""
    quant = (read_config(folder) or {}).get("quantization_config") or {}
    return quant.get("quant_method") == "modelopt" and quant.get("quant_algo") == "NVFP4"


def is_nvfp4_weight(name: str, tensor: torch.Tensor, locations: dict) -> bool:
    return tensor.dtype == torch.uint8 and name + SCALE in locations


def companion_of(name: str, locations: dict) -> str | None:
    """The weight an NVFP4 scale tensor belongs to (read together with it), or None."""
    for suffix in (SCALE_2, SCALE):
        if name.endswith(".weight" + suffix) and name[: -len(suffix)] in locations:
            return name[: -len(suffix)]
    if name.endswith(".input_scale") and name[: -len("input_scale")] + "weight" in locations:
        return name[: -len("input_scale")] + "weight"
    return None


def read_nvfp4(name: str, packed: torch.Tensor, fetch) -> torch.Tensor:
    """Dequantise `name`; `fetch(tensor_name)` reads a sibling tensor."""
    try:
        return dequantize_nvfp4(packed, fetch(name + SCALE), fetch(name + SCALE_2))
    except (KeyError, ValueError) as exc:
        raise CheckpointError(f"NVFP4 tensor {name}: {exc}") from None


# ---- writing a checkpoint (scripts/quantize_nvfp4.py) -------------------------------------


def _quant_config(excluded: list[str]) -> dict:
    return {"quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": GROUP,
            "exclude_modules": excluded}  # fmt: skip


def quantize_checkpoint_nvfp4(src_dir: str | Path, dst_dir: str | Path, twin_dir=None) -> None:
    """Write the ModelOpt-NVFP4 copy of `src_dir` (routed experts quantised) to `dst_dir`; with
    `twin_dir`, also its dequantised twin: the same model with every quantised weight replaced
    by its float32 dequantisation (what the NVFP4 checkpoint must compute exactly)."""
    src, dst = Path(src_dir), Path(dst_dir)
    config = read_config(src)
    if config is None or config.get("quantization_config"):
        raise CheckpointError(f"{src / CONFIG_NAME}: needs an unquantised checkpoint")
    outs = [p for p in (dst, twin_dir and Path(twin_dir)) if p is not None]
    for out in outs:
        if out.exists() and any(out.iterdir()):
            raise CheckpointError(f"output folder {out} exists and is not empty")
        out.mkdir(parents=True, exist_ok=True)
        for item in src.iterdir():
            if item.suffix != ".safetensors" and item.name != INDEX_NAME and item.is_file():
                shutil.copy2(item, out / item.name)
    excluded = set()
    for file in find_checkpoint_files(src):
        quantised, twin = {}, {}
        with open_safetensors(file) as handle:
            for name in handle.keys():
                tensor = get_tensor(handle, name, file)
                for piece, value in (split_fused_experts(name, tensor) or {name: tensor}).items():
                    if ROUTED_EXPERT_RE.search(piece) and value.dim() == 2:
                        parts = quantize_nvfp4(value)
                        for suffix, part in parts.items():
                            quantised[piece + suffix] = part.contiguous()
                        quantised[piece[: -len("weight")] + "input_scale"] = torch.tensor(1.0)
                        twin[piece] = dequantize_nvfp4(parts[""], parts[SCALE], parts[SCALE_2])
                    else:
                        quantised[piece] = twin[piece] = value.contiguous()
                        if piece.endswith(".weight"):
                            excluded.add(piece.removesuffix(".weight"))
        save_file(quantised, str(dst / file.name), metadata={"format": "pt"})
        if twin_dir is not None:
            save_file(twin, str(Path(twin_dir) / file.name), metadata={"format": "pt"})
    quant = _quant_config(sorted(excluded))
    producer = {"name": "modelopt", "version": "dsaserve-quantize_nvfp4"}
    (dst / QUANT_CONFIG_NAME).write_text(
        json.dumps({"producer": producer, "quantization": quant}, indent=2) + "\n"
    )
    config["quantization_config"] = {"quant_method": "modelopt", **quant}
    (dst / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
