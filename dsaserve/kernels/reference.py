"""The torch reference of each hot op: the eager code every other backend is checked against.

Shapes: B rows (decode tokens), H heads, L candidate entries per row, C = rank + rope.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dsaserve.kernels.block_fp8 import dequantize_block_fp8
from dsaserve.kernels.indexer_scan import decode_scores
from dsaserve.kernels.kv_quant import KV_STORE
from dsaserve.kernels.topk import topk_earliest


def indexer_scores(
    q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor
) -> torch.Tensor:
    """I[b, l] = sum_h weights[b, h] * ReLU(q[b, h] . keys[b, l]), -inf where not valid.
    q [B, H, D], weights [B, H] (scales folded in), keys [B, L, D], valid [B, L]; fp32."""
    scores = torch.relu(torch.einsum("bhd,bld->bhl", q.float(), keys.float()))
    scores = torch.einsum("bh,bhl->bl", weights.float(), scores)
    return scores.masked_fill(~valid, float("-inf"))


def indexer_decode_topk(q, weights, cache, slots, valid, k: int) -> torch.Tensor:
    """Top-k positions [B, k] (into slots' columns, earlier wins ties) of the decode rows: the
    scores of `indexer_scores`, key tile by key tile (kernels/indexer_scan.py)."""
    return topk_earliest(decode_scores(q, weights, cache, slots, valid), k)


def softmax_attend(q, keys, allowed, rank: int, scale: float) -> torch.Tensor:
    """q [b, H, C] over keys [b, L, C] where allowed [b, L]; returns [b, H, rank]."""
    scores = torch.einsum("bhc,blc->bhl", q, keys) * scale
    scores = scores.masked_fill(~allowed[:, None, :], float("-inf"))
    probs = scores.softmax(dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.einsum("bhl,blr->bhr", probs, keys[..., :rank])


def sparse_mla_decode(q, cache, slots, allowed, rank: int, scale: float) -> torch.Tensor:
    """Absorbed-form MLA of decode rows q [B, H, C] over the cache entries `slots` [B, L]
    (the selected top-k, or the whole context) where `allowed`: [B, H, rank] in q's dtype."""
    keys = KV_STORE.read_entry(cache, slots, rank, q.dtype)
    return softmax_attend(q, keys, allowed, rank, scale)


def fp8_linear(x, w8, scale_inv, bias=None) -> torch.Tensor:
    """x @ dequant(w8, scale_inv).T (+ bias): block-FP8 [N, K] weights with 128x128 scales."""
    w = dequantize_block_fp8(w8, scale_inv).to(x.dtype)
    return F.linear(x, w, bias)
