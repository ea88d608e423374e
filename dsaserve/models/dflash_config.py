"""`DFlashConfig.from_dir(path)`: a DFlash / DFlash2 drafter's config.json, normalised once.

The format is the public reference's (z-lab/dflash, `dflash/model.py`): a Qwen3-style config
(`model_type` qwen3) whose `architectures` is `DFlashDraftModel` or `DFlash2DraftModel`, with a
`dflash_config` object holding `block_size`, `target_layer_ids`, `mask_token_id` and, for
DFlash2, `conv_kernel_size`, `conv_group_size`, `selector_rank`, `selector_top_k`,
`output_multiplier` and `final_logit_softcapping`. A `dflash_config` field falls back to the
top-level field of the same name, as the reference's `_draft_value` does.

`check_fits(target)` refuses a drafter built for another target, in one line naming the field:
it shares the target's embedding and LM head (hidden size, vocab) and reads the hidden states of
the target layers `target_layer_ids` names.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dsaserve.model_config import ConfigError, ModelConfig, RopeConfig, rope_from_hf
from dsaserve.models.checkpoint_files import read_config

ARCHITECTURES = ("DFlashDraftModel", "DFlash2DraftModel")


@dataclass(frozen=True)
class DFlashConfig:
    path: str
    architecture: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    attention_bias: bool
    rope: RopeConfig
    causal: tuple[bool, ...]  # per layer: block rows see only earlier block rows
    windows: tuple[int | None, ...]  # per layer: sliding window (None: the whole context)
    block_size: int
    target_layer_ids: tuple[int, ...]
    mask_token_id: int
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    conv_kernel_size: int = 0  # DFlash2 only from here on
    conv_group_size: int = 0
    selector_rank: int = 0
    selector_top_k: int = 0

    @property
    def is_v2(self) -> bool:
        return self.architecture == "DFlash2DraftModel"

    @property
    def kv_dim(self) -> int:
        """Width of one layer's cached context entry: K and V of every KV head."""
        return 2 * self.num_kv_heads * self.head_dim

    def verify_block(self, flag: int | None) -> int:
        """The verify window: --speculative-dflash-block-size (`flag`), else the checkpoint's."""
        return flag or self.block_size

    def context_bytes_per_token(self, itemsize: int) -> int:
        """The drafter's context entry per target token (every layer's K and V), in bytes."""
        return self.num_layers * self.kv_dim * itemsize

    @classmethod
    def from_dir(cls, path: str | Path) -> DFlashConfig:
        raw = read_config(Path(path))
        if raw is None:
            raise ConfigError(f"no config.json in the drafter folder {path}")
        return cls.from_dict(raw, str(path))

    @classmethod
    def from_dict(cls, raw: dict[str, Any], path: str = "") -> DFlashConfig:
        arch = (raw.get("architectures") or [None])[0]
        if arch not in ARCHITECTURES:
            raise ConfigError(f"{path}/config.json: architectures {arch!r} is not a DFlash "
                              f"drafter ({' or '.join(ARCHITECTURES)})")  # fmt: skip
        draft = raw.get("dflash_config") or {}
        value = lambda name, default=None: draft.get(name, raw.get(name, default))  # noqa: E731
        layers = int(raw["num_hidden_layers"])
        heads = int(raw["num_attention_heads"])
        head_dim = int(raw.get("head_dim") or raw["hidden_size"] // heads)
        ids = value("target_layer_ids")
        if not ids:
            raise ConfigError(f"{path}/config.json: dflash_config.target_layer_ids is missing")
        v2 = arch == "DFlash2DraftModel"
        softcap = value("final_logit_softcapping")
        config = cls(
            path=path, architecture=arch, hidden_size=int(raw["hidden_size"]), num_layers=layers,
            num_heads=heads, num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=head_dim, intermediate_size=int(raw["intermediate_size"]),
            vocab_size=int(raw["vocab_size"]), rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            attention_bias=bool(raw.get("attention_bias", False)),
            rope=rope_from_hf(raw, head_dim), causal=_causal(raw, layers),
            windows=_windows(raw, layers), block_size=int(value("block_size", 16)),
            target_layer_ids=tuple(int(i) for i in ids),
            mask_token_id=int(value("mask_token_id", 0)),
            input_embedding_scale=float(value("input_embedding_scale", 1.0)),
            output_multiplier=float(value("output_multiplier", 1.0)),
            final_logit_softcapping=float(softcap) if softcap else None,
            conv_kernel_size=int(value("conv_kernel_size", 0)) if v2 else 0,
            conv_group_size=int(value("conv_group_size", 0)) if v2 else 0,
            selector_rank=int(value("selector_rank", 0)) if v2 else 0,
            selector_top_k=int(value("selector_top_k", 0)) if v2 else 0,
        )  # fmt: skip
        config._validate()
        return config

    def _validate(self) -> None:
        where = f"{self.path}/config.json"
        if self.block_size < 2:
            raise ConfigError(f"{where}: dflash_config.block_size {self.block_size} must be >= 2")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"{where}: num_attention_heads {self.num_heads} is not a multiple "
                              f"of num_key_value_heads {self.num_kv_heads}")  # fmt: skip
        if self.output_multiplier <= 0:
            raise ConfigError(f"{where}: dflash_config.output_multiplier {self.output_multiplier} "
                              "must be positive")  # fmt: skip
        if not self.is_v2:
            return
        for name in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{where}: dflash_config.{name} is missing (DFlash2)")
        if self.hidden_size % self.conv_group_size:
            raise ConfigError(f"{where}: conv_group_size {self.conv_group_size} does not divide "
                              f"hidden_size {self.hidden_size}")  # fmt: skip

    def check_fits(self, target: ModelConfig) -> None:
        """ConfigError in one line naming the field when this drafter cannot serve `target`."""
        where = f"--speculative-draft-model-path {self.path}"
        if self.hidden_size != target.hidden_size:
            raise ConfigError(f"{where}: hidden_size {self.hidden_size} does not fit the "
                              f"target's hidden_size {target.hidden_size}")  # fmt: skip
        if self.vocab_size != target.vocab_size:
            raise ConfigError(f"{where}: vocab_size {self.vocab_size} does not fit the target's "
                              f"vocab_size {target.vocab_size}")  # fmt: skip
        layers = target.num_hidden_layers
        bad = [i for i in self.target_layer_ids if not 0 <= i < layers]
        if bad:
            raise ConfigError(f"{where}: dflash_config.target_layer_ids {list(bad)} are not "
                              f"layers of the target (0..{layers - 1})")  # fmt: skip
        if not 0 <= self.mask_token_id < target.vocab_size:
            raise ConfigError(f"{where}: dflash_config.mask_token_id {self.mask_token_id} is not "
                              f"in the target's vocabulary ({target.vocab_size})")  # fmt: skip


def _layer_types(raw: dict[str, Any], layers: int) -> list[str]:
    types = raw.get("layer_types")
    if types:
        return list(types)[:layers]
    sliding = raw.get("use_sliding_window") and raw.get("sliding_window")
    first = int(raw.get("max_window_layers", 28)) if sliding else layers  # Qwen3Config's default
    return ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]


def _causal(raw: dict[str, Any], layers: int) -> tuple[bool, ...]:
    """As the reference: `is_causal` when the config sets it, else causal on sliding layers."""
    flag = raw.get("is_causal")
    types = _layer_types(raw, layers)
    return tuple(t == "sliding_attention" if flag is None else bool(flag) for t in types)


def _windows(raw: dict[str, Any], layers: int) -> tuple[int | None, ...]:
    """Qwen3Config keeps `sliding_window` only under `use_sliding_window`."""
    window = raw.get("sliding_window") if raw.get("use_sliding_window") else None
    types = _layer_types(raw, layers)
    return tuple(int(window) if t == "sliding_attention" and window else None for t in types)
