"""Tiny checkpoints with an MTP (nextn) layer, for the speculative-decoding tests.

`tiny_models.make_checkpoint` saves a transformers model, which has no MTP layer; `add_mtp_layer`
appends one at `model.layers.{num_hidden_layers}.*` (a transformers decoder layer plus enorm,
hnorm, eh_proj and shared_head.norm, as model.md §5 names them) and sets
`num_nextn_predict_layers: 1`.

`mode="random"`: random weights (drafts are almost always rejected). `mode="echo"`: the layer
passes the target's hidden state through (eh_proj picks the hidden half, attention and MLP
outputs are zero), so each draft repeats the target's last prediction: accepted inside the
repetition loops tiny random models fall into, rejected elsewhere, which exercises every
accept length.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tiny_models import _randomise_moe, make_checkpoint
from transformers import AutoConfig
from transformers.models.deepseek_v32.modeling_deepseek_v32 import DeepseekV32DecoderLayer
from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import GlmMoeDsaDecoderLayer


def mixed_prompts() -> list[list[int]]:
    """Seven seeded random prompts of mixed lengths (1 to 40 tokens) over a 380-token range."""
    generator = torch.Generator().manual_seed(7)
    lengths = [3, 9, 17, 40, 5, 1, 21]
    return [torch.randint(0, 380, (n,), generator=generator).tolist() for n in lengths]


def check_native_verify(monkeypatch) -> list[int]:
    """Make every native verify (`ModelRunner.run_verify` on the native decode layers) also run
    the layered model on the same batch and assert the same logits and states (fp32, 1e-4);
    returns the row counts of the verifies checked (filled as they run)."""
    from dsaserve.engine.decode.runner import ModelRunner

    native_run, checked = ModelRunner.run_verify, []

    def both(self, batch, rows, taps=()):
        logits, states = native_run(self, batch, rows, taps)
        step = self.decode_step
        if self.graphs is None and step is not None and step.accepts(batch):  # it ran natively
            hidden = self.run_target(batch, taps)
            width = hidden.shape[1] // (1 + len(taps))
            want = hidden[:, width:] if taps else hidden
            assert torch.allclose(states, want, atol=1e-4, rtol=1e-4)
            assert torch.allclose(logits, self.model.logits(hidden[rows, :width]), atol=1e-4)
            checked.append(len(rows))
        return logits, states

    monkeypatch.setattr(ModelRunner, "run_verify", both)
    return checked


def make_mtp_checkpoint(
    folder: Path, kind: str = "glm", seed: int = 0, mode: str = "echo", **overrides
) -> Path:
    """`make_checkpoint` plus an MTP layer (see the module docstring for `mode`)."""
    make_checkpoint(folder, kind, seed, **overrides)
    return add_mtp_layer(folder, seed, mode)


def add_mtp_layer(folder: Path, seed: int = 0, mode: str = "echo") -> Path:
    if mode not in ("echo", "random"):
        raise ValueError(f"mode must be 'echo' or 'random', got {mode!r}")
    config = AutoConfig.from_pretrained(folder)
    tensors = load_file(str(folder / "model.safetensors"))
    prefix = f"model.layers.{config.num_hidden_layers}."
    tensors |= {prefix + k: v for k, v in _mtp_tensors(config, seed, mode).items()}
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    raw = json.loads((folder / "config.json").read_text())
    raw["num_nextn_predict_layers"] = 1
    (folder / "config.json").write_text(json.dumps(raw, indent=2))
    return folder


def _mtp_tensors(config, seed: int, mode: str) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed + 1000)
    layer_config = copy.deepcopy(config)
    n = config.num_hidden_layers
    layer_config.num_hidden_layers = n + 1
    if getattr(config, "mlp_layer_types", None) is not None:
        layer_config.mlp_layer_types = list(config.mlp_layer_types) + ["sparse"]
    if getattr(config, "indexer_types", None) is not None:
        layer_config.indexer_types = list(config.indexer_types) + ["full"]
    cls = GlmMoeDsaDecoderLayer if config.model_type == "glm_moe_dsa" else DeepseekV32DecoderLayer
    layer = cls(layer_config, n).float()
    _init_random(layer)
    hidden = config.hidden_size
    extra = {
        "enorm.weight": torch.ones(hidden),
        "hnorm.weight": torch.ones(hidden),
        "eh_proj.weight": torch.randn(hidden, 2 * hidden) * hidden**-0.5,
        "shared_head.norm.weight": torch.ones(hidden),
    }
    tensors = {k: v.detach().clone().contiguous() for k, v in layer.state_dict().items()}
    if mode == "echo":
        _make_echo(tensors, extra, hidden)
    return tensors | extra


def _init_random(layer: torch.nn.Module) -> None:
    with torch.no_grad():
        for name, param in layer.named_parameters():
            if param.dim() >= 2 and "experts" not in name:
                param.normal_(0, 0.02)
            elif "norm" in name and param.dim() == 1:
                param.fill_(1.0)
    _randomise_moe(layer)


def _make_echo(tensors: dict[str, torch.Tensor], extra: dict[str, torch.Tensor], hidden: int):
    """Zero every residual branch's output and let eh_proj pass the hidden half through."""
    for name, value in tensors.items():
        if name.endswith(("o_proj.weight", "down_proj.weight", "down_proj")):
            tensors[name] = torch.zeros_like(value)
    extra["eh_proj.weight"] = torch.cat([torch.zeros(hidden, hidden), torch.eye(hidden)], dim=1)
