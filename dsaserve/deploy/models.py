"""Model descriptions for planning: the built-in checkpoints and any `config.json`.

Only the sizes that decide memory are kept. Parameter counts are computed from these fields
(`dsaserve.deploy.memory`), never looked up in a size table.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dsaserve.assets import default_drafter_path, default_model_path
from dsaserve.deploy.hardware import PlanError

DSA_MODEL_TYPES = ("glm_moe_dsa", "deepseek_v32")


@dataclass(frozen=True)
class ModelSpec:
    """The config fields that size a DSA MoE model, plus its checkpoint precision."""

    name: str
    model_path: str
    model_type: str
    precision: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    index_n_heads: int
    index_head_dim: int
    n_routed_experts: int
    n_shared_experts: int
    moe_intermediate_size: int
    intermediate_size: int
    first_k_dense_replace: int
    vocab_size: int
    num_nextn_predict_layers: int
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    dflash_drafter: str | None = None  # a published DFlash / DFlash2 drafter for this model

    @property
    def family(self) -> str:
        return "glm" if self.model_type == "glm_moe_dsa" else "deepseek"

    @property
    def reasoning_parser(self) -> str:
        return "glm45" if self.family == "glm" else "deepseek-v3"

    @property
    def tool_call_parser(self) -> str:
        return "glm47" if self.family == "glm" else "deepseekv32"

    @property
    def has_mtp(self) -> bool:
        return self.num_nextn_predict_layers > 0


_GLM5 = dict(
    model_type="glm_moe_dsa", hidden_size=6144, num_hidden_layers=78, num_attention_heads=64,
    q_lora_rank=2048, kv_lora_rank=512, qk_nope_head_dim=192, qk_rope_head_dim=64,
    v_head_dim=256, index_n_heads=32, index_head_dim=128, n_routed_experts=256,
    n_shared_experts=1, moe_intermediate_size=2048, intermediate_size=12288,
    first_k_dense_replace=3, vocab_size=154880, num_nextn_predict_layers=1,
    max_position_embeddings=202752,
)  # fmt: skip
_DEEPSEEK_V32 = dict(
    model_type="deepseek_v32", hidden_size=7168, num_hidden_layers=61, num_attention_heads=128,
    q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
    v_head_dim=128, index_n_heads=64, index_head_dim=128, n_routed_experts=256,
    n_shared_experts=1, moe_intermediate_size=2048, intermediate_size=18432,
    first_k_dense_replace=3, vocab_size=129280, num_nextn_predict_layers=1,
    max_position_embeddings=163840,
)  # fmt: skip

# the deployment guide's DFlash2 drafter (block size 8 in its dflash_config)
_GLM53_DRAFTER = dict(dflash_drafter="incoai/GLM-5.3-DFlash2")
# GLM-5.3 keeps GLM-5's sizes (model.md §1); only rope_theta (8e6) differs, which planning ignores.
BUILTIN_MODELS: dict[str, ModelSpec] = {
    m.name: m
    for m in [
        ModelSpec("GLM-5.3", "zai-org/GLM-5.3", precision="fp8", **_GLM5, **_GLM53_DRAFTER),
        ModelSpec(
            "GLM-5.3-BF16", "zai-org/GLM-5.3-BF16", precision="bf16", **_GLM5, **_GLM53_DRAFTER
        ),
        ModelSpec(
            "GLM-5.3-NVFP4", "nvidia/GLM-5.3-NVFP4", precision="nvfp4", **_GLM5, **_GLM53_DRAFTER
        ),
        ModelSpec("DeepSeek-V3.2", "deepseek-ai/DeepSeek-V3.2", precision="fp8", **_DEEPSEEK_V32),
    ]
}

_REQUIRED = [
    "hidden_size", "num_hidden_layers", "num_attention_heads", "kv_lora_rank",
    "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "index_n_heads", "index_head_dim",
    "n_routed_experts", "moe_intermediate_size", "intermediate_size", "vocab_size",
]  # fmt: skip


def load_model(name_or_path: str, model_path: str | None = None) -> ModelSpec:
    """A built-in name (case-insensitive), a checkpoint folder, or a `config.json` file."""
    by_lower = {key.lower(): spec for key, spec in BUILTIN_MODELS.items()}
    spec = by_lower.get(name_or_path.lower())
    if spec is None:
        spec = _from_checkpoint(Path(name_or_path))
    return dataclasses.replace(spec, model_path=model_path) if model_path else spec


def _from_checkpoint(path: Path) -> ModelSpec:
    config_file = path / "config.json" if path.is_dir() else path
    if not config_file.is_file():
        names = ", ".join(BUILTIN_MODELS)
        raise PlanError(f"--model {path}: not a built-in model ({names}) nor a config.json")
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as e:
        raise PlanError(f"--model {path}: cannot read {config_file}: {e}") from e
    folder = config_file.parent
    spec = spec_from_config(config, name=folder.name, model_path=str(folder), folder=folder)
    if folder.resolve() == default_model_path().resolve():  # it ships its DFlash2 drafter
        spec = dataclasses.replace(spec, dflash_drafter=str(default_drafter_path()))
    return spec


def spec_from_config(
    config: dict[str, Any], name: str, model_path: str, folder: Path | None = None
) -> ModelSpec:
    """Read the sizing fields of a Hugging Face `config.json` dict, naming what is missing."""
    model_type = config.get("model_type")
    if model_type not in DSA_MODEL_TYPES:
        kinds = ", ".join(DSA_MODEL_TYPES)
        raise PlanError(f"model_type {model_type!r} is not a DSA model ({kinds})")
    missing = [key for key in _REQUIRED if config.get(key) is None]
    if missing:
        raise PlanError(f"config.json lacks {', '.join(missing)}")
    fields = {key: int(config[key]) for key in _REQUIRED}
    return ModelSpec(
        name=name,
        model_path=model_path,
        model_type=model_type,
        precision=_precision(config, folder),
        q_lora_rank=config.get("q_lora_rank"),
        n_shared_experts=int(config.get("n_shared_experts") or 0),
        first_k_dense_replace=int(config.get("first_k_dense_replace") or 0),
        num_nextn_predict_layers=int(config.get("num_nextn_predict_layers") or 0),
        max_position_embeddings=int(config.get("max_position_embeddings") or 4096),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        **fields,
    )


def _precision(config: dict[str, Any], folder: Path | None) -> str:
    quant = config.get("quantization_config") or {}
    if folder is not None and (folder / "hf_quant_config.json").is_file():
        quant = json.loads((folder / "hf_quant_config.json").read_text()).get("quantization", quant)
    method = str(quant.get("quant_method", "")).lower()
    algo = str(quant.get("quant_algo", "")).upper()
    if method == "fp8":
        return "fp8"
    if "NVFP4" in algo or method == "nvfp4":
        return "nvfp4"
    if quant:
        raise PlanError(f"unsupported quantization_config {quant}: use FP8, NVFP4 or unquantised")
    dtype = str(config.get("torch_dtype") or config.get("dtype") or "bfloat16")
    return "fp32" if dtype in ("float32", "fp32") else "bf16"
