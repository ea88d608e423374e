"""Training the DSA indexer: an auxiliary KL loss against the main attention (DeepSeek-V3.2 style).

transformers runs `GlmMoeDsaIndexer.forward` under `torch.no_grad` (its top-k selection is not
differentiable), so the LM loss never reaches the indexer weights. `indexer_kl` recomputes the
index scores with gradients from the indexer's (detached) inputs and returns the cross-entropy
between the detached, head-summed, L1-normalised attention distribution and softmax(index scores)
over the tokens the attention could see: all causal tokens while training densely (warm-up), only
the selected top-k once sparse attention is on. It trains the indexer only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import apply_rotary_pos_emb_interleave


def index_scores(
    indexer: nn.Module, hidden: torch.Tensor, q_resid: torch.Tensor, cos_sin
) -> torch.Tensor:
    """The indexer's scores I(t, s) with gradients, [B, S, T] (no mask applied)."""
    batch, seq, _ = hidden.shape
    rope = indexer.qk_rope_head_dim
    q = indexer.wq_b(q_resid).view(batch, seq, indexer.n_heads, indexer.head_dim)
    q_rot, q_pass = torch.split(q, [rope, indexer.head_dim - rope], dim=-1)
    k = indexer.k_norm(indexer.wk(hidden)).unsqueeze(2)  # [B, S, 1, D]
    k_rot, k_pass = torch.split(k, [rope, indexer.head_dim - rope], dim=-1)
    cos, sin = cos_sin
    q_rot, k_rot = apply_rotary_pos_emb_interleave(q_rot, k_rot, cos, sin, unsqueeze_dim=2)
    q = torch.cat([q_rot, q_pass], dim=-1)  # [B, S, H, D]
    k = torch.cat([k_rot, k_pass], dim=-1).squeeze(2)  # [B, T, D]
    scores = F.relu(torch.einsum("bshd,btd->bsht", q, k) * indexer.softmax_scale)
    weights = indexer.weights_proj(hidden) * indexer.n_heads**-0.5  # [B, S, H]
    return torch.einsum("bsh,bsht->bst", weights, scores)


def indexer_kl(attn, x, q_resid, cos_sin, query, key, mask, rows: int) -> torch.Tensor:
    """CE(attention target, softmax(index scores)) on the first `rows` sequences of the batch.

    query/key: the MLA query and key, [B, heads, S, qk_head_dim]; mask: [B, S, T] bool, the
    tokens each query attended to.
    """
    with torch.no_grad():
        logits = torch.matmul(query[:rows], key[:rows].transpose(-1, -2)) * attn.scaling
        probs = torch.softmax(logits.masked_fill(~mask[:rows, None], float("-inf")), dim=-1)
        target = probs.sum(1)  # head-summed
        target = target / target.sum(-1, keepdim=True).clamp_min(1e-9)
    cos, sin = (t[:rows] for t in cos_sin)
    scores = index_scores(attn.indexer, x[:rows].detach(), q_resid[:rows].detach(), (cos, sin))
    logq = torch.log_softmax(scores.float().masked_fill(~mask[:rows], -1e9), dim=-1)
    valid = mask[:rows].any(-1)
    per_row = -(target * logq).sum(-1)
    return (per_row * valid).sum() / valid.sum().clamp_min(1)
