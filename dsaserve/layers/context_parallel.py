"""Context-parallel prefill (`--attn-cp-size N --enable-prefill-cp --cp-strategy interleave`).

The CP ranks are the attention group's ranks (`--attn-cp-size` equals `--tp`, `--dp 1`), each
holding the whole attention (heads are not split). In a forward whose rows are all prefill
(extend) rows, row i of the flattened chunk belongs to CP rank i mod N (interleave: every rank
gets the same share of early and late positions, so the causal work is balanced). Per layer:

1. each rank computes its rows' projections (q_a/q_b, kv_a, the indexer's query and key);
2. one all-gather of the new latent entries (and one of the new indexer keys, for layers with
   their own indexer) fills every rank's KV pool with every new token, so the pool stays the
   same on every rank and decode needs nothing from CP;
3. each rank runs the indexer top-k and the attention for its own queries only, over the whole
   context (cached prefix + every new token);
4. one all-gather of the attention outputs gives every rank all rows again, and the MLP/MoE
   block and the LM head run as the layout says (over all ranks).

Decode steps (any forward with decode rows: decodes, speculative verify and catch-up) are not
split: every rank computes the same attention (no collective), as the guide advises. The MTP
layer is never split (its selection is reused by later draft steps).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from dsaserve.distributed.parallel_state import ParallelState
from dsaserve.kernels.indexer_scan import causal_topk
from dsaserve.layers.forward_batch import ForwardBatch, current_batch, gather_rows
from dsaserve.layers.indexer import Selection, row_blocks
from dsaserve.layers.layer_split import fetch_layer
from dsaserve.layers.rotary import apply_rotary


class ContextParallel:
    """One rank's share of a prefill forward and the all-gathers that rebuild the whole."""

    def __init__(self, parallel: ParallelState) -> None:
        self.parallel = parallel
        self.size = parallel.sizes.cp
        self.rank = parallel.attn_rank % self.size
        self.gathered_bytes = 0  # bytes this rank received in CP all-gathers (bench, docs)

    @staticmethod
    def applies(batch: ForwardBatch) -> bool:
        """Only pure prefill forwards are split."""
        return bool(batch.extends) and batch.decode_rows.numel() == 0

    def rows(self, total: int) -> torch.Tensor:
        return torch.arange(self.rank, total, self.size)

    def gather(self, mine: torch.Tensor, total: int) -> torch.Tensor:
        """Every rank's rows (rank r holds rows r, r + N, ...) back in row order: [total, ...]."""
        width = -(-total // self.size)
        padded = mine.new_zeros(width, *mine.shape[1:])
        padded[: mine.shape[0]] = mine
        parts = [torch.empty_like(padded) for _ in range(self.size)]
        start = time.perf_counter()
        torch.distributed.all_gather(parts, padded.contiguous(), group=self.parallel.cp_group)
        self.parallel.comm_seconds += time.perf_counter() - start
        self.gathered_bytes += padded.numel() * padded.element_size() * (self.size - 1)
        stacked = torch.stack(parts, dim=1)  # [width, N, ...]: row j * N + r
        return stacked.reshape(width * self.size, *mine.shape[1:])[:total]

    def _own_slice(self, start: int, length: int) -> slice:
        """Indices into this rank's rows of the global rows [start, start + length)."""
        lo = -(-(start - self.rank) // self.size)
        hi = -(-(start + length - self.rank) // self.size)
        return slice(max(lo, 0), max(hi, 0))

    def attention(self, attn: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  shared: Selection | None) -> tuple[torch.Tensor, Selection]:  # fmt: skip
        """MLAttention.forward for this rank's rows; returns every row's output and this
        rank's selection (reused by the layers that share the indexer, which split alike)."""
        batch, total = current_batch(), x.shape[0]
        mine = self.rows(total).to(x.device)
        xm, cm, sm = x[mine], cos[mine], sin[mine]
        q_resid, q_full, entry = attn.project(xm, cm, sm)
        cache = batch.kv_cache[attn.layer_id]
        cache.index_copy_(0, batch.out_slots, self.gather(entry.to(cache.dtype), total))
        fetch_layer(batch, attn.layer_id)  # LayerSplit: this layer's entries from their owner
        positions = self._positions(batch, total).to(x.device)[mine]
        if attn.indexer is not None:
            selection = self._index(attn.indexer, batch, xm, q_resid, cm, sm, positions)
        else:
            selection = shared
        w_uv = attn.absorbed()[1]
        out = q_full.new_empty(q_full.shape[0], attn.n_heads, attn.rank)
        for seq, selected in zip(batch.extends, selection.extends):
            own = self._own_slice(seq.q_start, seq.q_len)
            if own.stop > own.start:
                ctx = gather_rows(cache, seq.ctx_slots).to(q_full.dtype)
                out[own] = _attend(attn, q_full[own], ctx, positions[own], selected)
        o = attn.o_proj(torch.einsum("thr,hvr->thv", out, w_uv).reshape(len(mine), -1))
        return self.gather(o, total), selection

    @staticmethod
    def _positions(batch: ForwardBatch, total: int) -> torch.Tensor:
        """Each row's position within its own run's context (the causal limit)."""
        pos = torch.zeros(total, dtype=torch.long)
        for seq in batch.extends:
            first = seq.ctx_len - seq.q_len
            pos[seq.q_start : seq.q_start + seq.q_len] = first + torch.arange(seq.q_len)
        return pos

    @torch.no_grad()
    def _index(self, ix: Any, batch: ForwardBatch, xm, q_resid, cm, sm, positions) -> Selection:
        """The indexer for this rank's queries, after every rank's new keys are in the cache."""
        q = ix.wq_b(q_resid).view(-1, ix.n_heads, ix.head_dim)
        k = ix.k_norm(ix.wk(xm))
        q = torch.cat([apply_rotary(q[..., : ix.rope_dim], cm, sm, ix.interleave),
                       q[..., ix.rope_dim :]], dim=-1)  # fmt: skip
        k = torch.cat([apply_rotary(k[..., : ix.rope_dim], cm, sm, ix.interleave),
                       k[..., ix.rope_dim :]], dim=-1)  # fmt: skip
        cache = batch.index_cache[ix.cache_index]
        new_keys = self.gather(k.to(cache.dtype), batch.out_slots.numel())
        cache.index_copy_(0, batch.out_slots, new_keys)
        weights = ix.weights_proj(xm.to(ix.weights_proj.weight.dtype)).float()
        weights = weights * (ix.n_heads**-0.5 * ix.head_dim**-0.5)
        extends = []
        for seq in batch.extends:
            own = self._own_slice(seq.q_start, seq.q_len)
            extends.append(_select(ix, seq, q[own], weights[own], positions[own], cache))
        return Selection(extends, None)


def _select(ix: Any, seq, q, weights, pos, cache) -> torch.Tensor | None:
    """Top-k context positions of the rows at positions `pos` of one run (Indexer's scoring)."""
    if seq.ctx_len <= ix.topk:
        return None
    keys = gather_rows(cache, seq.ctx_slots).float()
    return causal_topk(q, weights, keys, pos, ix.topk)


def _attend(attn: Any, q, ctx, pos, selected: torch.Tensor | None) -> torch.Tensor:
    """MLAttention._attend_extend for rows at positions `pos` (not necessarily contiguous)."""
    out = q.new_empty(len(pos), attn.n_heads, attn.rank)
    width = ctx.shape[0] if selected is None else selected.shape[1]
    for rows in row_blocks(len(pos), attn.n_heads * width + width * ctx.shape[1]):
        limit = pos[rows][:, None]
        if selected is None:
            keys = ctx.expand(rows.stop - rows.start, -1, -1)
            allowed = torch.arange(ctx.shape[0], device=limit.device)[None, :] <= limit
        else:
            keys = gather_rows(ctx, selected[rows])
            allowed = selected[rows] <= limit
        out[rows] = attn._softmax_attend(q[rows], keys, allowed)
    return out


def context_parallel(parallel: ParallelState) -> ContextParallel | None:
    return ContextParallel(parallel) if parallel.sizes.cp > 1 else None
