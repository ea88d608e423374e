"""A training-speed forward for `GlmMoeDsaForCausalLM` on CPU, over the same modules and weights.

It computes the same math as transformers' eager forward (MLA with interleaved RoPE, DSA top-k
from the model's own indexer modules, MoE with shared expert) but runs attention through
`scaled_dot_product_attention` with a boolean mask, skips the indexer while training densely,
and computes the indexer KL target (head-summed attention probabilities) only for a few rows of
the batch. `check_matches_reference` asserts it equals the transformers forward, sparse path
included; the training script runs it before training.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from default_model_indexer import indexer_kl
from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import apply_rotary_pos_emb_interleave


class FastOut(NamedTuple):
    hidden: torch.Tensor  # final hidden state after model.norm, [B, S, H]
    kl: torch.Tensor  # indexer KL (0 when not requested)


def attention(attn, x, cos_sin, allowed, sparse: bool, kl_rows: int):
    """MLA self-attention; allowed: [B, S, T] bool (causal & key padding). Returns (out, kl)."""
    batch, seq, _ = x.shape
    q_resid = attn.q_a_layernorm(attn.q_a_proj(x))
    q = attn.q_b_proj(q_resid).view(batch, seq, -1, attn.qk_head_dim).transpose(1, 2)
    q_pass, q_rot = torch.split(q, [attn.qk_nope_head_dim, attn.qk_rope_head_dim], dim=-1)
    kv_pass, k_rot = torch.split(
        attn.kv_a_proj_with_mqa(x), [attn.kv_lora_rank, attn.qk_rope_head_dim], dim=-1
    )
    k_rot = k_rot.view(batch, 1, seq, attn.qk_rope_head_dim)
    q_rot, k_rot = apply_rotary_pos_emb_interleave(q_rot, k_rot, *cos_sin)
    kv = attn.kv_b_proj(attn.kv_a_layernorm(kv_pass)).view(
        batch, seq, -1, attn.qk_nope_head_dim + attn.v_head_dim
    )
    k_nope, value = torch.split(
        kv.transpose(1, 2), [attn.qk_nope_head_dim, attn.v_head_dim], dim=-1
    )
    key = torch.cat([k_nope, k_rot.expand(-1, k_nope.shape[1], -1, -1)], dim=-1)
    query = torch.cat([q_pass, q_rot], dim=-1)  # [B, heads, S, qk_head_dim]
    mask = allowed
    topk = None
    if sparse:
        with torch.no_grad():
            # the additive float mask transformers uses, so top-k ties break the same way
            additive = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(x.dtype).min)
            topk = attn.indexer(x, q_resid, cos_sin, additive, None)  # [B, S, k]
        chosen = torch.zeros_like(allowed).scatter(-1, topk.long(), True)
        mask = allowed & chosen
    out = F.scaled_dot_product_attention(
        query, key, value, attn_mask=mask[:, None], scale=attn.scaling
    )
    out = attn.o_proj(out.transpose(1, 2).reshape(batch, seq, -1))
    kl = torch.zeros(())
    if kl_rows:
        kl = indexer_kl(attn, x, q_resid, cos_sin, query, key, mask, kl_rows)
    return out, kl


def layer_forward(layer, h, cos_sin, allowed, sparse: bool, kl_rows: int):
    attn_out, kl = attention(
        layer.self_attn, layer.input_layernorm(h), cos_sin, allowed, sparse, kl_rows
    )
    h = h + attn_out
    return h + layer.mlp(layer.post_attention_layernorm(h)), kl


def allowed_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    seq = attention_mask.shape[1]
    causal = torch.ones(seq, seq, dtype=torch.bool).tril()
    return causal[None] & attention_mask.bool()[:, None, :]


def forward(model, input_ids, attention_mask, sparse: bool, kl_rows: int = 0) -> FastOut:
    inner = model.model
    h = inner.embed_tokens(input_ids)
    positions = torch.arange(input_ids.shape[1])[None].expand(input_ids.shape[0], -1)
    cos_sin = inner.rotary_emb(h, position_ids=positions)
    allowed = allowed_mask(attention_mask)
    kl = torch.zeros(())
    for layer in inner.layers:
        h, layer_kl = layer_forward(layer, h, cos_sin, allowed, sparse, kl_rows)
        kl = kl + layer_kl
    hidden = inner.norm(h)
    return FastOut(hidden, kl / len(inner.layers))


@torch.no_grad()
def check_matches_reference(model, input_ids, attention_mask, topk: int) -> tuple[float, float]:
    """(median, fraction > 1e-3) of per-token max |logit diff| against transformers' forward.

    Top-k selection is discontinuous: a near-tie in index scores can flip one token's selection
    under 1e-6 float noise, so a few positions may differ while the rest match to float precision.
    """
    saved = [layer.self_attn.indexer.index_topk for layer in model.model.layers]
    for layer in model.model.layers:
        layer.self_attn.indexer.index_topk = topk
    try:
        ref = model(input_ids=input_ids, attention_mask=attention_mask).logits
        fast = model.lm_head(forward(model, input_ids, attention_mask, sparse=True).hidden)
    finally:
        for layer, value in zip(model.model.layers, saved):
            layer.self_attn.indexer.index_topk = value
    per_token = (ref - fast).abs().amax(-1)[attention_mask.bool()]
    return per_token.median().item(), (per_token > 1e-3).float().mean().item()
