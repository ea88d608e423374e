"""Multi-head latent attention over the paged cache, in the weight-absorbed form.

Each cache entry is [normalised latent c_kv (kv_lora_rank) | roped key k_pe (rope dim)]. The
query absorbs W_UK so every head scores the shared entry directly; W_UV is applied to the
attended latent. The softmax scale stays qk_head_dim^-0.5 (times the YaRN mscale^2).
"""

from __future__ import annotations

import torch
from torch import nn

from dsaserve.distributed.parallel_state import ParallelState
from dsaserve.kernels.kv_quant import KV_STORE
from dsaserve.kernels.reference import softmax_attend
from dsaserve.layers.context_parallel import context_parallel
from dsaserve.layers.forward_batch import ForwardBatch, current_batch, gather_rows
from dsaserve.layers.indexer import Indexer, Selection, row_blocks
from dsaserve.layers.layer_split import fetch_layer
from dsaserve.layers.linear import ColumnParallelLinear, RowParallelLinear
from dsaserve.layers.norm import RMSNorm
from dsaserve.layers.rotary import apply_rotary
from dsaserve.model_config import ModelConfig


class MLAttention(nn.Module):
    """Under attention TP the heads are split (q_b_proj, kv_b_proj column-parallel, o_proj
    row-parallel); q_a_proj, kv_a_proj_with_mqa, their norms and the indexer are replicated, so
    every rank of the group stores the whole latent entry and indexer key of every token."""

    def __init__(
        self,
        config: ModelConfig,
        layer_id: int,
        index_cache_id: int | None,
        parallel: ParallelState | None = None,
    ) -> None:
        super().__init__()
        parallel = parallel or ParallelState.single()
        parts, part = parallel.sizes.head_tp, parallel.head_rank
        self.cp = context_parallel(parallel)  # None unless --enable-prefill-cp
        self.layer_id = layer_id
        self.n_heads = config.num_attention_heads // parts  # this rank's heads
        self.nope_dim = config.qk_nope_head_dim
        self.rope_dim = config.qk_rope_head_dim
        self.v_dim = config.v_head_dim
        self.rank = config.kv_lora_rank
        self.scale = config.softmax_scale
        bias = config.attention_bias
        h = config.hidden_size
        self.q_a_proj = nn.Linear(h, config.q_lora_rank, bias=bias)
        self.q_a_layernorm = RMSNorm(config.q_lora_rank, eps=1e-6)
        heads = config.num_attention_heads
        self.q_b_proj = ColumnParallelLinear(
            config.q_lora_rank, heads * config.qk_head_dim, parts, part
        )
        self.kv_a_proj_with_mqa = nn.Linear(h, config.kv_entry_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.rank, eps=1e-6)
        self.kv_b_proj = ColumnParallelLinear(
            self.rank, heads * (self.nope_dim + self.v_dim), parts, part
        )
        self.o_proj = RowParallelLinear(
            heads * self.v_dim, h, parts, part, bias=bias,
            reduce=parallel.all_reduce_attn if parts > 1 else None,
        )  # fmt: skip
        self.indexer = None if index_cache_id is None else Indexer(config, index_cache_id)

    def absorbed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK [H, nope, rank] and W_UV [H, v, rank], views of kv_b_proj."""
        w = self.kv_b_proj.weight.view(self.n_heads, self.nope_dim + self.v_dim, self.rank)
        return w[:, : self.nope_dim], w[:, self.nope_dim :]

    def project(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The rows' projections: (q_resid, the indexer's query input; the absorbed queries
        [T, H, rank + rope]; the rows' cache entries [T, rank + rope] = [latent || k_pe])."""
        q_resid = self.q_a_layernorm(self.q_a_proj(x))
        q = self.q_b_proj(q_resid).view(-1, self.n_heads, self.nope_dim + self.rope_dim)
        q_nope, q_pe = q.split([self.nope_dim, self.rope_dim], dim=-1)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([self.rank, self.rope_dim], dim=-1)
        k_pe = apply_rotary(k_pe, cos, sin, interleave=True)
        entry = torch.cat([self.kv_a_layernorm(latent), k_pe], -1)  # [T, 576]
        q_lat = torch.einsum("thd,hdr->thr", q_nope, self.absorbed()[0])  # [T, H, rank]
        q_full = torch.cat([q_lat, apply_rotary(q_pe, cos, sin, interleave=True)], -1)  # [T,H,576]
        return q_resid, q_full, entry

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, shared: Selection | None
    ) -> tuple[torch.Tensor, Selection]:
        batch = current_batch()
        if self.cp is not None and self.cp.applies(batch):
            return self.cp.attention(self, x, cos, sin, shared)
        q_resid, q_full, entry = self.project(x, cos, sin)
        cache = batch.kv_cache[self.layer_id]
        KV_STORE.write_entry(cache, batch.out_slots, entry, self.rank)
        fetch_layer(batch, self.layer_id)  # LayerSplit: this layer's entries from their owner
        selection = self.indexer(x, q_resid, cos, sin) if self.indexer is not None else shared
        w_uv = self.absorbed()[1]
        out = q_full.new_empty(q_full.shape[0], self.n_heads, self.rank)
        for seq, selected in zip(batch.extends, selection.extends):
            rows = slice(seq.q_start, seq.q_start + seq.q_len)
            ctx = KV_STORE.read_entry(cache, seq.ctx_slots, self.rank, q_full.dtype)
            out[rows] = self._attend_extend(q_full[rows], ctx, seq, selected)
        if batch.decode_rows.numel():
            out[batch.decode_rows] = self._attend_decode(q_full, cache, batch, selection.decode)
        attn = torch.einsum("thr,hvr->thv", out, w_uv).reshape(x.shape[0], -1)
        return self.o_proj(attn), selection

    def _attend_extend(self, q, ctx, seq, selected: torch.Tensor | None) -> torch.Tensor:
        """Attention of one run's rows, in row blocks so the workspace stays bounded. Sparse rows
        attend only their gathered top-k entries; dense runs (context <= index_topk) all."""
        ctx = ctx.to(q.dtype)
        first = seq.ctx_len - seq.q_len
        out = q.new_empty(seq.q_len, self.n_heads, self.rank)
        width = seq.ctx_len if selected is None else selected.shape[1]
        for rows in row_blocks(seq.q_len, self.n_heads * width + width * ctx.shape[1]):
            pos = first + torch.arange(rows.start, rows.stop)
            if selected is None:
                keys = ctx.expand(rows.stop - rows.start, -1, -1)  # [b, L, 576] (a view)
                allowed = torch.arange(seq.ctx_len)[None, :] <= pos[:, None]
            else:
                keys = gather_rows(ctx, selected[rows])  # [b, k, 576]
                allowed = selected[rows] <= pos[:, None]
            out[rows] = self._softmax_attend(q[rows], keys, allowed)
        return out

    def _softmax_attend(self, q, keys, allowed) -> torch.Tensor:
        """q [b, H, 576] over keys [b, L, 576] where allowed [b, L]; returns [b, H, rank]."""
        return softmax_attend(q, keys, allowed, self.rank, self.scale)

    def _attend_decode(self, q_full, cache, batch: ForwardBatch, selected) -> torch.Tensor:
        """Decode rows attend their whole (padded) context, or only their top-k entries."""
        slots, allowed = batch.decode_slots, batch.decode_valid
        if selected is not None and selected.dtype == torch.bool:
            allowed = allowed & selected
        elif selected is not None:
            slots, allowed = slots.gather(1, selected), allowed.gather(1, selected)  # [Bd, k]
        q = q_full[batch.decode_rows]  # the `sparse_mla` op (kernels/registry.py)
        return batch.kernels.sparse_mla(q, cache, slots, allowed, self.rank, self.scale)
