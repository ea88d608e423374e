"""Random DFlash / DFlash2 drafters in the published format, for any target checkpoint.

The config follows z-lab/dflash's `tests/fixtures/dflash2-config.json` (Qwen3 fields, a
`dflash_config` object, sliding-window layer types optional) and the tensors its
`dflash2-safetensors-header.json`: `fc`, `hidden_norm`, `norm`, `layers.N.{self_attn,mlp,
input_layernorm,post_attention_layernorm,attention_conv,mlp_conv}.*` and
`candidate_selector.{hidden_projection.weight,predecessor_codebook,successor_codebook}` (the
codebooks without a `.weight` suffix). Written with safetensors directly, not through dsaserve,
so a loader that expected other names would fail on it.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file


def drafter_config(target: dict, *, v2: bool = True, layers: int = 2, block_size: int = 4,
                   taps: list[int] | None = None, heads: int = 4, kv_heads: int = 2,
                   head_dim: int = 16, window: int | None = None, mask_token_id: int = 1,
                   causal: bool = False) -> dict:  # fmt: skip
    n = target["num_hidden_layers"]
    taps = taps if taps is not None else sorted({0, n // 2, n - 1})
    draft = {"block_size": block_size, "target_layer_ids": taps, "mask_token_id": mask_token_id}
    if v2:
        draft |= {"conv_kernel_size": 2, "conv_group_size": 8, "selector_rank": 16,
                  "selector_top_k": 4, "output_multiplier": 0.5,
                  "final_logit_softcapping": 20.0}  # fmt: skip
    kind = "sliding_attention" if window else "full_attention"
    return {
        "architectures": ["DFlash2DraftModel" if v2 else "DFlashDraftModel"],
        "model_type": "qwen3", "attention_bias": False, "attention_dropout": 0.0,
        "is_causal": causal, "dflash_config": draft, "dtype": "bfloat16", "head_dim": head_dim,
        "hidden_act": "silu", "hidden_size": target["hidden_size"], "initializer_range": 0.02,
        "intermediate_size": 2 * target["hidden_size"], "layer_types": [kind] * layers,
        "max_position_embeddings": 65536, "max_window_layers": layers,
        "num_attention_heads": heads, "num_hidden_layers": layers, "num_key_value_heads": kv_heads,
        "num_target_layers": n, "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"},
        "sliding_window": window, "tie_word_embeddings": False, "use_cache": False,
        "use_sliding_window": bool(window), "vocab_size": target["vocab_size"],
    }  # fmt: skip


def random_tensors(config: dict, seed: int = 0, scale: float = 0.05) -> dict[str, torch.Tensor]:
    """The published tensor names and shapes, random bf16 values (norms near 1)."""
    gen = torch.Generator().manual_seed(seed)
    h, d = config["hidden_size"], config["head_dim"]
    heads, kv, inter = config["num_attention_heads"], config["num_key_value_heads"], config[
        "intermediate_size"]  # fmt: skip
    draft = config["dflash_config"]
    rand = lambda *shape: (torch.randn(*shape, generator=gen) * scale).bfloat16()  # noqa: E731
    norm = lambda n: (1 + torch.randn(n, generator=gen) * 0.1).bfloat16()  # noqa: E731
    out = {"fc.weight": rand(h, h * len(draft["target_layer_ids"])),
           "hidden_norm.weight": norm(h), "norm.weight": norm(h)}  # fmt: skip
    for i in range(config["num_hidden_layers"]):
        p = f"layers.{i}."
        out |= {p + "input_layernorm.weight": norm(h),
                p + "post_attention_layernorm.weight": norm(h),
                p + "self_attn.q_proj.weight": rand(heads * d, h),
                p + "self_attn.k_proj.weight": rand(kv * d, h),
                p + "self_attn.v_proj.weight": rand(kv * d, h),
                p + "self_attn.o_proj.weight": rand(h, heads * d),
                p + "self_attn.q_norm.weight": norm(d), p + "self_attn.k_norm.weight": norm(d),
                p + "mlp.gate_proj.weight": rand(inter, h),
                p + "mlp.up_proj.weight": rand(inter, h),
                p + "mlp.down_proj.weight": rand(h, inter)}  # fmt: skip
        if "conv_kernel_size" in draft:
            k, groups = draft["conv_kernel_size"], h // draft["conv_group_size"]
            for conv in ("attention_conv", "mlp_conv"):
                base = rand(2, k, h).float()
                base[:, 0] += 1.0
                out[p + f"{conv}.base_kernel"] = base.bfloat16()
                out[p + f"{conv}.kernel_projection.weight"] = rand(2 * k * groups, h)
    if "selector_rank" in draft:
        r, vocab = draft["selector_rank"], config["vocab_size"]
        out |= {"candidate_selector.hidden_projection.weight": rand(r, h),
                "candidate_selector.predecessor_codebook": rand(vocab, r) * 20,
                "candidate_selector.successor_codebook": rand(vocab, r) * 20}  # fmt: skip
    return out


def write_drafter(folder: Path, target_dir: Path, seed: int = 0, **kw) -> Path:
    """A random drafter for the checkpoint in `target_dir`, written to `folder`."""
    target = json.loads((Path(target_dir) / "config.json").read_text())
    config = drafter_config(target, **kw)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    save_file(random_tensors(config, seed), str(folder / "model.safetensors"))
    return folder
