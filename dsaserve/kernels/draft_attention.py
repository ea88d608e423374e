"""The `draft_attention` op's torch reference: a DFlash drafter's block over its cached context.

Each of R requests drafts a block of B rows. Row b of request r attends the drafter's cached
context entries `cache[ctx_slots[r, l]]` where `ctx_allowed[r, b, l]` (its context before the
block, a sliding window if the drafter has one) and the block's own keys and values where
`block_allowed[b, b']` (all of them: the block is non-causal; causal drafters mask the upper
triangle). A cache entry is [K ‖ V] of every KV head, [2 * kv_heads * d]; queries may have more
heads than keys (GQA: head h reads KV head h // (heads / kv_heads)). One scaled-dot-product
attention over the gathered context and the block (torch's SDPA: fp32 softmax for fp32 inputs).

Shapes: q [R, B, Hq, d]; cache [slots, 2 * Hkv * d]; ctx_slots [R, L] (padding: any slot);
ctx_allowed [R, B, L] bool; k_block, v_block [R, B, Hkv, d]; block_allowed [B, B] bool.
Returns [R, B, Hq, d] in q's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def draft_attention(q, cache, ctx_slots, ctx_allowed, k_block, v_block, block_allowed,
                    scale: float) -> torch.Tensor:  # fmt: skip
    rows, block, heads, dim = q.shape
    kv_heads = k_block.shape[2]
    ctx = cache.index_select(0, ctx_slots.reshape(-1)).view(rows, -1, 2, kv_heads, dim)
    keys = torch.cat([ctx[:, :, 0].to(q.dtype), k_block], dim=1)  # [R, L + B, Hkv, d]
    values = torch.cat([ctx[:, :, 1].to(q.dtype), v_block], dim=1)
    allowed = torch.cat([ctx_allowed, block_allowed[None].expand(rows, -1, -1)], dim=-1)
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        keys.transpose(1, 2),
        values.transpose(1, 2),
        attn_mask=allowed[:, None],
        scale=scale,
        enable_gqa=True,
    )  # [R, Hq, B, d]; query head h reads KV head h // (Hq / Hkv)
    return out.transpose(1, 2)
