"""`ModelConfig.from_hf(path)`: the HF config normalised once; model code reads only it."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUPPORTED = {"glm_moe_dsa": "GlmMoeDsaForCausalLM", "deepseek_v32": "DeepseekV32ForCausalLM"}


class ConfigError(ValueError):
    """The checkpoint folder or its config.json cannot be served; the message names the file."""


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    dim: int
    yarn_factor: float | None = None  # None: default RoPE
    original_max_position: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True

    def softmax_mscale(self) -> float:
        """The YaRN factor on the attention softmax scale (mscale_all_dim squared), else 1."""
        if self.yarn_factor is None or not self.mscale_all_dim:
            return 1.0
        return yarn_mscale(self.yarn_factor, self.mscale_all_dim) ** 2


def yarn_mscale(scale: float, mscale: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


@dataclass(frozen=True)
class ModelConfig:
    path: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    n_group: int
    topk_group: int
    routed_scaling_factor: float
    norm_topk_prob: bool
    mlp_layer_types: tuple[str, ...]
    rms_norm_eps: float
    attention_bias: bool
    index_topk: int
    index_n_heads: int
    index_head_dim: int
    indexer_types: tuple[str, ...]
    indexer_rope_interleave: bool
    index_share_for_mtp_iteration: bool
    rope: RopeConfig
    max_position_embeddings: int
    num_nextn_predict_layers: int
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...]
    torch_dtype: str
    quantization: str | None

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_entry_dim(self) -> int:
        """Width of one MLA cache entry: normalised latent followed by the roped key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        return self.qk_head_dim**-0.5 * self.rope.softmax_mscale()

    @property
    def context_length(self) -> int:
        return self.max_position_embeddings

    @classmethod
    def from_hf(cls, path: str | Path, overrides: dict | None = None) -> ModelConfig:
        raw = _read_config(Path(path))
        raw.update(overrides or {})
        return cls._from_dict(str(path), raw)

    @classmethod
    def _from_dict(cls, path: str, raw: dict[str, Any]) -> ModelConfig:
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED:
            raise ConfigError(
                f"{path}/config.json: model_type {model_type!r} is not supported "
                f"(supported: {', '.join(SUPPORTED)})"
            )
        try:
            return cls(path=path, model_type=model_type, **_normalise(model_type, raw))
        except KeyError as e:
            raise ConfigError(f"{path}/config.json: missing field {e.args[0]!r}") from None


def _read_config(path: Path) -> dict:
    file = path / "config.json"
    if not path.is_dir():
        raise ConfigError(f"model path {path} is not a folder")
    if not file.is_file():
        raise ConfigError(f"{file} not found: a checkpoint folder needs config.json")
    try:
        raw = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{file} is not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{file} must hold a JSON object")
    return raw


# the fields a config.json must have, taken as they are (in the order a missing one is named)
REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
            "num_attention_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
            "qk_rope_head_dim", "v_head_dim", "n_routed_experts",
            "num_experts_per_tok")  # fmt: skip


def _normalise(model_type: str, raw: dict) -> dict:
    layers = raw["num_hidden_layers"]
    dense = min(raw.get("first_k_dense_replace", 3), layers)
    mlp_types = raw.get("mlp_layer_types") or ["dense"] * dense + ["sparse"] * (layers - dense)
    eos = raw.get("eos_token_id", [])
    return dict(
        **{name: raw[name] for name in REQUIRED},  # KeyError: _from_dict names the field
        num_hidden_layers=layers,
        n_shared_experts=raw.get("n_shared_experts") or 0,
        n_group=raw.get("n_group") or 1,
        topk_group=raw.get("topk_group") or 1,
        routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)),
        norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
        mlp_layer_types=tuple(mlp_types),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        attention_bias=bool(raw.get("attention_bias", False)),
        index_topk=raw.get("index_topk", 2048),
        index_n_heads=raw.get("index_n_heads", 64 if model_type == "deepseek_v32" else 32),
        index_head_dim=raw.get("index_head_dim", 128),
        indexer_types=tuple(_indexer_types(raw, layers)),
        indexer_rope_interleave=bool(
            raw.get("indexer_rope_interleave", model_type == "glm_moe_dsa")
        ),
        index_share_for_mtp_iteration=bool(raw.get("index_share_for_mtp_iteration", False)),
        rope=_rope(raw),
        max_position_embeddings=raw.get("max_position_embeddings", 4096),
        num_nextn_predict_layers=raw.get("num_nextn_predict_layers") or 0,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        eos_token_ids=tuple(eos if isinstance(eos, list) else [eos] if eos is not None else []),
        torch_dtype=str(raw.get("dtype") or raw.get("torch_dtype") or "bfloat16"),
        quantization=(raw.get("quantization_config") or {}).get("quant_method"),
    )


def _indexer_types(raw: dict, layers: int) -> list[str]:
    """Per-layer "full"/"shared", from indexer_types, index_topk_pattern or freq/offset."""
    if raw.get("indexer_types"):
        types = list(raw["indexer_types"])
    elif raw.get("index_topk_pattern"):
        pattern = raw["index_topk_pattern"]
        types = [{"F": "full", "S": "shared"}[c] for c in pattern]
    else:
        freq = max(raw.get("index_topk_freq", 1), 1)
        offset = raw.get("index_skip_topk_offset", 2)
        types = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(layers)]
    if len(types) != layers or types[0] != "full":
        raise ConfigError(f"indexer_types must have {layers} entries and start with 'full'")
    return types


def rope_from_hf(raw: dict, dim: int) -> RopeConfig:
    """The RoPE of any HF config (`rope_parameters` / `rope_scaling`) over `dim` rotated dims."""
    return _rope({**raw, "qk_rope_head_dim": dim})


def _rope(raw: dict) -> RopeConfig:
    params = dict(raw.get("rope_scaling") or {})
    params.update(raw.get("rope_parameters") or {})
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    dim = raw["qk_rope_head_dim"]
    if kind in (None, "default"):
        return RopeConfig(theta=theta, dim=dim)
    if kind != "yarn":
        raise ConfigError(f"rope type {kind!r} is not supported (default or yarn)")
    return RopeConfig(
        theta=theta,
        dim=dim,
        yarn_factor=float(params["factor"]),
        original_max_position=int(params.get("original_max_position_embeddings", 4096)),
        beta_fast=float(params.get("beta_fast") or 32),
        beta_slow=float(params.get("beta_slow") or 1),
        mscale=params.get("mscale"),
        mscale_all_dim=params.get("mscale_all_dim"),
        truncate=bool(params.get("truncate", True)),
    )
