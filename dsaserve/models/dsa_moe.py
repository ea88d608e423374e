"""The GLM-5.x / DeepSeek-V3.2 model family (`glm_moe_dsa`, `deepseek_v32`), config-driven.

Parameter names equal the Hugging Face checkpoint names, so loading is a lookup. The MTP (nextn)
layer, when kept, is `model.layers[num_hidden_layers]` and has its own cache entries.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from dsaserve.distributed.parallel_state import ParallelState
from dsaserve.layers.forward_batch import current_batch
from dsaserve.layers.indexer import Selection
from dsaserve.layers.linear import ParallelLMHead, VocabParallelEmbedding
from dsaserve.layers.mla import MLAttention
from dsaserve.layers.moe import MLP, MoE
from dsaserve.layers.norm import RMSNorm
from dsaserve.layers.rotary import Rotary
from dsaserve.layers.taps import join_taps
from dsaserve.model_config import ModelConfig


def index_cache_ids(config: ModelConfig, with_mtp: bool) -> dict[int, int]:
    """Layer id -> row of the pool's index cache, for layers that run their own indexer."""
    full = [i for i, t in enumerate(config.indexer_types) if t == "full"]
    if with_mtp:
        full.append(config.num_hidden_layers)
    return {layer: row for row, layer in enumerate(full)}


class DecoderLayer(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        layer_id: int,
        index_cache_id: int | None,
        parallel: ParallelState | None = None,
    ) -> None:
        super().__init__()
        self.parallel = parallel = parallel or ParallelState.single()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = MLAttention(config, layer_id, index_cache_id, parallel)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        dense = layer_id < config.num_hidden_layers and config.mlp_layer_types[layer_id] == "dense"
        self.mlp = (
            MLP(config.hidden_size, config.intermediate_size, parallel.world, parallel.rank)
            if dense
            else MoE(config, parallel)
        )

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, shared: Selection | None
    ) -> tuple[torch.Tensor, Selection]:
        if x.shape[0]:  # an idle DP-attention group has no tokens but still joins the MLP
            attn, shared = self.self_attn(self.input_layernorm(x), cos, sin, shared)
            x = x + attn
        return x + self._mlp(self.post_attention_layernorm(x)), shared

    def _mlp(self, h: torch.Tensor) -> torch.Tensor:
        """The MLP block over every attention group's tokens, its parts summed over all ranks."""
        p = self.parallel
        return p.own_rows(p.all_reduce_world(self.mlp(p.gather_groups(h))))


class SharedHead(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class MTPLayer(DecoderLayer):
    """The nextn layer: drafts token i+2 from the embedding of token i+1 and the hidden state at i.

    u = eh_proj([enorm(emb) | hnorm(hidden)]); h' = decoder layer(u); logits = lm_head(norm(h')).
    """

    def __init__(
        self,
        config: ModelConfig,
        layer_id: int,
        index_cache_id: int | None,
        parallel: ParallelState | None = None,
    ) -> None:
        super().__init__(config, layer_id, index_cache_id, parallel)
        self.self_attn.cp = None  # never split: later draft steps reuse its selection
        h = config.hidden_size
        self.enorm = RMSNorm(h, config.rms_norm_eps)
        self.hnorm = RMSNorm(h, config.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.shared_head = SharedHead(config)

    def draft(
        self, embeds: torch.Tensor, hidden: torch.Tensor, cos, sin, reuse: Selection | None = None
    ) -> tuple[torch.Tensor, Selection]:
        """h' (un-normed) and the indexer selection; with `reuse`, that selection is attended
        instead of running the indexer (index_share_for_mtp_iteration)."""
        x = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(hidden)], dim=-1))
        if reuse is None:
            return super().forward(x, cos, sin, None)
        with _indexer_bypassed(self.self_attn):
            return super().forward(x, cos, sin, reuse)


@contextmanager
def _indexer_bypassed(attn: nn.Module) -> Iterator[None]:
    """Make `attn` take its `shared` selection instead of running its own indexer.

    Why: MLAttention runs its indexer whenever it has one; this keeps the MTP-only reuse out of
    the attention layer's interface."""
    indexer = attn.indexer
    attn.indexer = None
    try:
        yield
    finally:
        attn.indexer = indexer


class DsaMoeModel(nn.Module):
    def __init__(self, config: ModelConfig, with_mtp: bool, parallel: ParallelState) -> None:
        super().__init__()
        ids = index_cache_ids(config, with_mtp)
        n = config.num_hidden_layers
        self.embed_tokens = VocabParallelEmbedding(
            config.vocab_size, config.hidden_size, parallel.attn_tp, parallel.attn_rank,
            reduce=parallel.all_reduce_attn,
        )  # fmt: skip
        layers: list[nn.Module] = [DecoderLayer(config, i, ids.get(i), parallel) for i in range(n)]
        if with_mtp:
            layers.append(MTPLayer(config, n, ids[n], parallel))
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.num_hidden_layers = n


class DsaMoeForCausalLM(nn.Module):
    """Main model (+ optional MTP layer). `forward` runs the installed ForwardBatch and returns
    the final normed hidden states of every row; `logits` projects chosen rows. With a
    `parallel` state it is this rank's shard (see dsaserve/distributed/)."""

    def __init__(
        self, config: ModelConfig, with_mtp: bool = False, parallel: ParallelState | None = None
    ) -> None:
        super().__init__()
        self.config = config
        self.with_mtp = with_mtp
        self.parallel = parallel = parallel or ParallelState.single()
        self.model = DsaMoeModel(config, with_mtp, parallel)
        self.lm_head = ParallelLMHead(
            config.hidden_size, config.vocab_size, parallel.world, parallel.rank,
            gather=parallel.all_gather_last,
        )  # fmt: skip
        self.rotary = Rotary(config.rope)

    @property
    def mtp(self) -> MTPLayer:
        return self.model.layers[self.config.num_hidden_layers]

    @torch.inference_mode()
    def forward(self, taps: tuple[int, ...] = ()) -> torch.Tensor:
        """Final normed hidden states [T, H]; with `taps` (a DFlash drafter's target layers),
        [final ‖ each tapped layer's output] [T, H * (1 + len(taps))] (see `join_taps`)."""
        batch = current_batch()
        x = self.model.embed_tokens(batch.input_ids)
        cos, sin = self.rotary.cos_sin(batch.positions, x.dtype)
        selection, outputs = None, {}
        for i, layer in enumerate(self.model.layers[: self.config.num_hidden_layers]):
            x, selection = layer(x, cos, sin, selection)
            if i in taps:
                outputs[i] = x
        return join_taps(self.model.norm(x), outputs, taps, self.config.num_hidden_layers - 1)

    @torch.inference_mode()
    def forward_mtp(
        self, hidden: torch.Tensor, reuse: Selection | None = None
    ) -> tuple[torch.Tensor, Selection]:
        """Run the MTP layer on the installed batch: row r's input token is batch.input_ids[r]
        (token i+1) and hidden[r] the target's normed hidden state at i. Returns
        shared_head.norm(h'), which is both the lm_head input and, as in sglang
        (deepseek_nextn / glm4_moe_nextn) and vLLM (deepseek_mtp), the hidden state fed back
        into the next draft step; and the MTP indexer's selection."""
        batch = current_batch()
        embeds = self.model.embed_tokens(batch.input_ids)
        cos, sin = self.rotary.cos_sin(batch.positions, embeds.dtype)
        out, selection = self.mtp.draft(embeds, hidden, cos, sin, reuse)
        return self.mtp.shared_head.norm(out), selection

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The target's token embeddings (a DFlash drafter's noise block), any shape of ids."""
        return self.model.embed_tokens(input_ids.reshape(-1)).view(*input_ids.shape, -1)

    def forward_logits(self) -> torch.Tensor:
        """`forward`, then the logits of the installed batch's `logits_rows` [R, V]."""
        return self.logits(self.forward()[current_batch().logits_rows])

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        p = self.parallel
        return p.own_rows(self.lm_head(p.gather_groups(hidden))).float()
