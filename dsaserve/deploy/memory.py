"""Memory arithmetic: parameters from the config, weight bytes per GPU, KV bytes per token.

Parameters are grouped by how they are stored and sharded:

- attention: the per-head MLA projections (q_b_proj, kv_b_proj, o_proj), sharded over the
  attention-TP group (`tp / dp` under DP attention, so replicated when dp = tp).
- attention_replicated: q_a_proj, kv_a_proj_with_mqa and the indexer's wq_b and wk, replicated
  on every rank as SGLang keeps them (they are head-independent, or the indexer's own);
  `attention_kept` are the bf16 side weights (norms, weights_proj), replicated too.
- embedding: `embed_tokens`, sharded like attention (replicated under DP attention).
- mlp: dense FFN, shared and routed experts, sharded over all `tp` ranks (TP or EP alike).
- lm_head: vocab-parallel over all `tp` ranks.
- replicated: norms, router gates and biases, the MTP `eh_proj`; on every GPU.
"""

from __future__ import annotations

from typing import NamedTuple

from dsaserve.deploy.models import ModelSpec
from dsaserve.kernels.fp8_kv_sizes import mla_entry_bytes

FP8_BYTES = 1 + 4 / (128 * 128)  # e4m3 weight + one fp32 scale per 128x128 block
FP4_BYTES = 0.5 + 1 / 16  # e2m1 weight + one fp8 scale per 16 elements (NVFP4)

# bytes per parameter of each group, by checkpoint precision (model.md §6): FP8 quantises every
# projection; NVFP4 (ModelOpt) quantises the MLPs and keeps attention in bf16.
BYTES_PER_PARAM: dict[str, dict[str, float]] = {
    "fp8": {"attention": FP8_BYTES, "attention_replicated": FP8_BYTES, "mlp": FP8_BYTES},
    "nvfp4": {"mlp": FP4_BYTES},
    "bf16": {},
    "fp32": {"default": 4.0},
}


class ParamCounts(NamedTuple):
    """Parameter counts by storage/sharding group (see the module docstring)."""

    attention: int = 0
    attention_kept: int = 0
    attention_replicated: int = 0
    embedding: int = 0
    mlp: int = 0
    lm_head: int = 0
    replicated: int = 0

    def total(self) -> int:
        return sum(self)

    def __add__(self, other: tuple) -> ParamCounts:  # type: ignore[override]
        return ParamCounts(*(a + b for a, b in zip(self, other)))

    def scale(self, times: int) -> ParamCounts:
        return ParamCounts(*(value * times for value in self))


def _attention(m: ModelSpec) -> ParamCounts:
    h, heads = m.hidden_size, m.num_attention_heads
    q_in = m.q_lora_rank or h
    q_a = h * m.q_lora_rank if m.q_lora_rank else 0
    q_b = q_in * heads * (m.qk_nope_head_dim + m.qk_rope_head_dim)
    kv_a = h * (m.kv_lora_rank + m.qk_rope_head_dim)
    kv_b = m.kv_lora_rank * heads * (m.qk_nope_head_dim + m.v_head_dim)
    o_proj = heads * m.v_head_dim * h
    indexer = q_in * m.index_n_heads * m.index_head_dim + h * m.index_head_dim  # wq_b + wk
    kept = h * m.index_n_heads + 2 * m.index_head_dim + (m.q_lora_rank or 0) + m.kv_lora_rank
    return ParamCounts(attention=q_b + kv_b + o_proj, attention_kept=kept,
                       attention_replicated=q_a + kv_a + indexer)  # fmt: skip


def _moe_mlp(m: ModelSpec) -> ParamCounts:
    experts = m.n_routed_experts + m.n_shared_experts
    experts *= 3 * m.hidden_size * m.moe_intermediate_size
    router = m.n_routed_experts * m.hidden_size + m.n_routed_experts  # gate + correction bias
    return ParamCounts(mlp=experts, replicated=router)


def _decoder_layer(m: ModelSpec, moe: bool) -> ParamCounts:
    dense = ParamCounts(mlp=3 * m.hidden_size * m.intermediate_size)
    norms = ParamCounts(replicated=2 * m.hidden_size)
    return _attention(m) + (_moe_mlp(m) if moe else dense) + norms


def main_params(m: ModelSpec) -> ParamCounts:
    """The main model: embedding, every decoder layer, final norm and lm_head."""
    dense_layers = min(m.first_k_dense_replace, m.num_hidden_layers)
    moe_layers = m.num_hidden_layers - dense_layers
    head = 0 if m.tie_word_embeddings else m.vocab_size * m.hidden_size
    outer = ParamCounts(
        embedding=m.vocab_size * m.hidden_size, lm_head=head, replicated=m.hidden_size
    )
    layers = _decoder_layer(m, moe=False).scale(dense_layers)
    return outer + layers + _decoder_layer(m, moe=True).scale(moe_layers)


def mtp_params(m: ModelSpec) -> ParamCounts:
    """The MTP (nextn) layers: a MoE decoder layer plus enorm, hnorm, eh_proj, shared_head.norm;
    embedding and lm_head are shared with the main model (model.md §5)."""
    h = m.hidden_size
    extra = ParamCounts(replicated=3 * h + 2 * h * h)
    return (_decoder_layer(m, moe=True) + extra).scale(m.num_nextn_predict_layers)


def weight_bytes(counts: ParamCounts, precision: str) -> ParamCounts:
    """Bytes of each group at a checkpoint precision (unquantised groups stay bf16)."""
    table = BYTES_PER_PARAM[precision]
    default = table.get("default", 2.0)
    return ParamCounts(
        *(round(n * table.get(group, default)) for group, n in zip(ParamCounts._fields, counts))
    )


def weight_bytes_per_gpu(
    m: ModelSpec, precision: str, tp: int, attn_tp: int, with_mtp: bool
) -> int:
    """Weight bytes one GPU holds at tensor-parallel size `tp` and attention-TP `attn_tp`."""
    counts = main_params(m) + (mtp_params(m) if with_mtp else ParamCounts())
    b = weight_bytes(counts, precision)
    return round(
        (b.attention + b.embedding) / attn_tp
        + (b.mlp + b.lm_head) / tp
        + b.replicated
        + b.attention_kept
        + b.attention_replicated
    )


def kv_bytes_per_layer(m: ModelSpec, kv_dtype: str) -> int:
    """One token's cache in one layer: MLA latent + rope key, plus the indexer key.

    bf16: (512 + 64) x 2 B; fp8 (FlashMLA's ds_mla): 512 fp8 + 4 fp32 scales + 64 bf16 rope;
    the indexer key is fp8 with one fp32 scale (128 + 4 B) on GPU, fp32 on CPU.
    """
    return mla_bytes_per_layer(m, kv_dtype) + indexer_bytes_per_layer(m, kv_dtype)


def mla_bytes_per_layer(m: ModelSpec, kv_dtype: str) -> int:
    """One token's MLA entry (latent + rope key) in one layer."""
    if kv_dtype == "fp32":
        return (m.kv_lora_rank + m.qk_rope_head_dim) * 4
    if kv_dtype == "fp8_e4m3":  # the pool's own layout (kernels/kv_quant.py): 656 B for GLM-5
        return mla_entry_bytes(m.kv_lora_rank, m.qk_rope_head_dim)
    return 2 * (m.kv_lora_rank + m.qk_rope_head_dim)


def indexer_bytes_per_layer(m: ModelSpec, kv_dtype: str) -> int:
    """One token's indexer key in one layer: fp32 on CPU, fp8 + one fp32 scale otherwise."""
    return m.index_head_dim * 4 if kv_dtype == "fp32" else m.index_head_dim + 4


def kv_bytes_per_token(m: ModelSpec, kv_dtype: str, with_mtp: bool = False) -> int:
    """KV bytes per token over all layers (the MTP layers add their own entries)."""
    layers = m.num_hidden_layers + (m.num_nextn_predict_layers if with_mtp else 0)
    return layers * kv_bytes_per_layer(m, kv_dtype)


def layer_split_kv_bytes_per_token(
    m: ModelSpec, kv_dtype: str, cp: int, with_mtp: bool = False
) -> int:
    """One CP rank's KV bytes per token under LayerSplit (layers/layer_split.py): the MLA
    entries of its ceil(L / cp) main layers, one scratch layer for the others' fetched entries,
    every MTP layer; the indexer keys of every layer stay whole."""
    mtp = m.num_nextn_predict_layers if with_mtp else 0
    held = -(-m.num_hidden_layers // cp) + 1 + mtp
    indexed = m.num_hidden_layers + mtp
    return held * mla_bytes_per_layer(m, kv_dtype) + indexed * indexer_bytes_per_layer(m, kv_dtype)
