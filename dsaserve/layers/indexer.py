"""The DSA lightning indexer: scores every cached token per query, keeps the top `index_topk`.

I(t, s) = sum_h w_h(t) * n_heads^-0.5 * d^-0.5 * ReLU(q_h(t) . k(s)), causal, no softmax. The
keys live in the pool's per-layer index cache. When the context is no longer than index_topk the
selection is every token (attention is then exactly dense), so nothing is scored. Equal scores
go to the earlier position (`topk_earliest`), so decode, prefill chunks, verify and draft rows
keep the same keys for the same query over the same prefix (docs/determinism.md).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from dsaserve.kernels.indexer_scan import causal_topk
from dsaserve.kernels.kv_quant import KV_STORE
from dsaserve.layers.forward_batch import ForwardBatch, current_batch
from dsaserve.layers.rotary import apply_rotary
from dsaserve.model_config import ModelConfig

WORKSPACE = 1 << 24  # elements of the largest score/gather buffer one row block may take


class Selection(NamedTuple):
    """Selected context positions: per extend run, the top-k positions of each row [q_len, k];
    for the decode rows, positions into the padded context [Bd, k] (or a bool mask [Bd, Lmax]).
    Picks beyond a row's own context are invalid and masked by the caller. None: every position."""

    extends: list[torch.Tensor | None]
    decode: torch.Tensor | None


def row_blocks(rows: int, cost_per_row: int) -> list[slice]:
    """Split `rows` into blocks whose workspace (cost_per_row each) stays under WORKSPACE."""
    size = max(1, WORKSPACE // max(cost_per_row, 1))
    return [slice(start, min(start + size, rows)) for start in range(0, rows, size)]


def row_mask(chosen: torch.Tensor | None, row: int, length: int) -> torch.Tensor | None:
    """The bool mask over [0, length) of row `row` of a selection (top-k positions or a mask)."""
    if chosen is None:
        return None
    if chosen.dtype == torch.bool:
        return chosen[row, :length]
    picks = chosen[row][chosen[row] < length]
    return torch.zeros(length, dtype=torch.bool, device=chosen.device).index_fill_(0, picks, True)


class Indexer(nn.Module):
    def __init__(self, config: ModelConfig, cache_index: int) -> None:
        super().__init__()
        self.n_heads = config.index_n_heads
        self.head_dim = config.index_head_dim
        self.rope_dim = config.qk_rope_head_dim
        self.topk = config.index_topk
        self.interleave = config.indexer_rope_interleave
        self.cache_index = cache_index
        self.wq_b = nn.Linear(config.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(config.hidden_size, self.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=1e-6)
        self.weights_proj = nn.Linear(config.hidden_size, self.n_heads, bias=False)

    @torch.no_grad()
    def forward(
        self, x: torch.Tensor, q_resid: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> Selection:
        batch = current_batch()
        q = self.wq_b(q_resid).view(-1, self.n_heads, self.head_dim)  # [T, nI, dI]
        k = self.k_norm(self.wk(x))  # [T, dI]
        q = torch.cat([apply_rotary(q[..., : self.rope_dim], cos, sin, self.interleave),
                       q[..., self.rope_dim :]], dim=-1)  # fmt: skip
        k = torch.cat([apply_rotary(k[..., : self.rope_dim], cos, sin, self.interleave),
                       k[..., self.rope_dim :]], dim=-1)  # fmt: skip
        cache = batch.index_cache[self.cache_index]
        KV_STORE.write_key(cache, batch.out_slots, k)
        weights = self.weights_proj(x.to(self.weights_proj.weight.dtype)).float()
        weights = weights * (self.n_heads**-0.5 * self.head_dim**-0.5)  # [T, nI]
        extends = [self._select_extend(batch, seq, q, weights, cache) for seq in batch.extends]
        return Selection(extends, self._select_decode(batch, q, weights, cache))

    def _select_extend(self, batch: ForwardBatch, seq, q, weights, cache) -> torch.Tensor | None:
        if seq.ctx_len <= self.topk:
            return None
        keys = KV_STORE.read_key(cache, seq.ctx_slots, torch.float32)  # [L, dI]
        rows = slice(seq.q_start, seq.q_start + seq.q_len)
        positions = seq.ctx_len - seq.q_len + torch.arange(seq.q_len, device=q.device)
        return causal_topk(q[rows], weights[rows], keys, positions, self.topk)  # [n, topk]

    def _select_decode(self, batch: ForwardBatch, q, weights, cache) -> torch.Tensor | None:
        if batch.decode_rows.numel() == 0 or batch.decode_slots.shape[1] <= self.topk:
            return None
        rows = batch.decode_rows  # the `indexer` op (kernels/registry.py)
        # q in the compute dtype: a bf16 one is the Triton kernel's dot dtype (tensor cores)
        return batch.kernels.indexer(q[rows], weights[rows], cache, batch.decode_slots,
                                     batch.decode_valid, self.topk)  # fmt: skip
