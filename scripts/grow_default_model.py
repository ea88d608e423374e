"""Deepen a trained default-model checkpoint by block expansion (LLaMA Pro, Wu et al. 2024).

    python scripts/grow_default_model.py SRC DST --layers 9

The first layers and the last layer of SRC keep their places; the new layers go in between,
each a copy of SRC's last MoE layer whose output projections (attention `o_proj`, the routed
experts' `down_proj`, the shared expert's `down_proj`) are zero, so every new layer adds nothing
to the residual stream and DST computes exactly what SRC computes (its MTP layer, renumbered,
included). Training DST (`train_default_model.py --init-from DST --layers N`) then puts the new
layers to work from that starting point.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file

LISTS = ("layer_types", "mlp_layer_types", "indexer_types")


def grow(src: Path, dst: Path, layers: int) -> None:
    config = json.loads((src / "config.json").read_text())
    old = config["num_hidden_layers"]
    if layers <= old:
        raise SystemExit(f"--layers {layers} must exceed the source's {old} layers")
    state = load_file(src / "model.safetensors")
    template = old - 1  # the last main layer: an MoE layer in the default model
    # new position -> source layer: 0..old-2 stay, the new ones, then the last layer and the MTP
    source = list(range(old - 1)) + [template] * (layers - old) + [old - 1, old]
    out = {k: v for k, v in state.items() if not k.startswith("model.layers.")}
    for new, old_id in enumerate(source):
        prefix = f"model.layers.{old_id}."
        fresh = old - 1 <= new < layers - 1
        for key, value in state.items():
            if key.startswith(prefix):
                name = key[len(prefix) :]
                value = value.clone()
                if fresh and _writes_residual(name):
                    value.zero_()
                out[f"model.layers.{new}.{name}"] = value
    config["num_hidden_layers"] = layers
    for key in LISTS:
        if key in config:
            values = config[key]
            config[key] = [values[i] for i in source[:layers]]
    dst.mkdir(parents=True, exist_ok=True)
    for item in src.iterdir():
        if item.name not in ("model.safetensors", "config.json", "train_log.jsonl", "eval.json"):
            shutil.copy2(item, dst / item.name)
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _writes_residual(name: str) -> bool:
    """Attention's o_proj and every down_proj of the MLP / experts (fused or per-expert names)."""
    return name == "self_attn.o_proj.weight" or (name.startswith("mlp.") and "down_proj" in name)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("src", type=Path)
    parser.add_argument("dst", type=Path)
    parser.add_argument("--layers", type=int, required=True)
    args = parser.parse_args()
    grow(args.src, args.dst, args.layers)


if __name__ == "__main__":
    main()
