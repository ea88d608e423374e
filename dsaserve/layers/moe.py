"""Feed-forward blocks: the SwiGLU MLP (dense layers, shared expert) and noaux_tc routed MoE."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dsaserve.distributed.parallel_state import ParallelState
from dsaserve.layers.linear import (
    ColumnParallelLinear,
    ExpertShard,
    RowParallelLinear,
    Shard,
    set_shard,
)
from dsaserve.model_config import ModelConfig

FEW = 16  # routing assignments (tokens x top-k) up to which they are grouped in Python


class MLP(nn.Module):
    """SwiGLU; split `parts` ways over the intermediate size, returning this part's partial sum
    (the decoder layer sums the parts once per MLP block)."""

    def __init__(self, hidden_size: int, intermediate_size: int, parts: int = 1,
                 index: int = 0) -> None:  # fmt: skip
        super().__init__()
        self.gate_proj = ColumnParallelLinear(hidden_size, intermediate_size, parts, index)
        self.up_proj = ColumnParallelLinear(hidden_size, intermediate_size, parts, index)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, parts, index)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Router(nn.Module):
    """Sigmoid scores in fp32; the bias steers selection only; group-limited top-k."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.n_group, self.topk_group = config.n_group, config.topk_group
        self.scaling = config.routed_scaling_factor
        self.normalise = config.norm_topk_prob
        n = config.n_routed_experts
        self.weight = nn.Parameter(torch.zeros(n, config.hidden_size, dtype=torch.float32))
        self.register_buffer("e_score_correction_bias", torch.zeros(n, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = F.linear(x.float(), self.weight.float()).sigmoid()  # [T, E]
        choice = scores + self.e_score_correction_bias
        if self.n_group > 1:
            grouped = choice.view(x.shape[0], self.n_group, -1)
            group_scores = grouped.topk(2, dim=-1).values.sum(-1)  # [T, G]
            keep = group_scores.topk(self.topk_group, dim=-1).indices
            group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
            choice = grouped.masked_fill(~group_mask[..., None], float("-inf")).view_as(choice)
        index = choice.topk(self.top_k, dim=-1).indices  # [T, k]
        weights = scores.gather(1, index)
        if self.normalise:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return index, weights * self.scaling


class Experts(nn.Module):
    """Routed experts as fused tensors: gate_up [E, 2I, H] (gate rows first), down [E, H, I].

    Under expert parallelism this rank holds experts [first, first + E / ep) and each expert's
    intermediate size is split `moe_tp` ways; the output is this rank's partial sum."""

    def __init__(self, config: ModelConfig, parallel: ParallelState | None = None) -> None:
        super().__init__()
        parallel = parallel or ParallelState.single()
        sizes = parallel.sizes
        e, h, i = config.n_routed_experts, config.hidden_size, config.moe_intermediate_size
        self.num_experts, count, inner = e, e // sizes.ep, i // sizes.moe_tp
        self.first = parallel.ep_rank * count
        self.gate_up_proj = nn.Parameter(torch.empty(count, 2 * inner, h))
        self.down_proj = nn.Parameter(torch.empty(count, h, inner))
        if sizes.tp > 1:
            rows = Shard(-2, parallel.moe_tp_rank, sizes.moe_tp)
            cols = Shard(-1, parallel.moe_tp_rank, sizes.moe_tp)
            set_shard(self.gate_up_proj, ExpertShard(self.first, count, rows))
            set_shard(self.down_proj, ExpertShard(self.first, count, cols))

    def forward(self, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj.shape[0] < self.num_experts:
            return self._local_experts(x, index, weights)
        if index.numel() <= FEW:
            return self._few(x, index, weights)
        flat = index.flatten()
        order = flat.argsort(stable=True)  # assignments grouped by expert
        counts = torch.bincount(flat, minlength=self.gate_up_proj.shape[0])
        token_of = order // index.shape[1]
        weight_of = weights.flatten()[order, None]
        cap = int(counts.max())
        # Every expert busy and little padding: one batched GEMM pair. Otherwise loop over the
        # busy experts only, so idle experts' weights are not read.
        if bool(counts.all()) and counts.numel() * cap <= 4 * flat.numel():
            y = self._padded(x[token_of], flat[order], counts, cap)
        else:
            y = torch.cat([self._expert(e, rows) for e, rows in self._groups(x, token_of, counts)])
        return torch.zeros_like(x).index_add_(0, token_of, (y * weight_of).to(x.dtype))

    def _local_experts(self, x, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Expert parallel: only the assignments to this rank's experts, grouped by expert."""
        local = index.flatten() - self.first
        slots = ((local >= 0) & (local < self.gate_up_proj.shape[0])).nonzero().squeeze(1)
        out = torch.zeros_like(x)
        if slots.numel() == 0:
            return out
        experts = local[slots]
        order = experts.argsort(stable=True)
        token_of = (slots // index.shape[1])[order]
        weight_of = weights.flatten()[slots][order, None]
        counts = torch.bincount(experts, minlength=self.gate_up_proj.shape[0])
        y = torch.cat([self._expert(e, rows) for e, rows in self._groups(x, token_of, counts)])
        return out.index_add_(0, token_of, (y * weight_of).to(x.dtype))

    def _groups(self, x: torch.Tensor, token_of: torch.Tensor, counts: torch.Tensor):
        start = 0
        for expert, count in enumerate(counts.tolist()):
            if count:
                yield expert, x[token_of[start : start + count]]
            start += count

    def _expert(self, expert: int, rows: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(rows, self.gate_up_proj[expert]).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, self.down_proj[expert])

    def _padded(self, rows, experts, counts, cap: int) -> torch.Tensor:
        """All experts at once over rows padded to `cap` per expert: [E, cap, H] GEMMs."""
        slot = torch.arange(rows.shape[0]) - (torch.cumsum(counts, 0) - counts)[experts]
        padded = rows.new_zeros(counts.numel(), cap, rows.shape[1])
        padded[experts, slot] = rows
        return self._batched(padded)[experts, slot]

    def _batched(self, rows: torch.Tensor) -> torch.Tensor:
        """Expert e over rows[e], for every expert: [E, n, H] -> [E, n, H] in two GEMMs."""
        gate, up = torch.bmm(rows, self.gate_up_proj.transpose(1, 2)).chunk(2, dim=-1)
        return torch.bmm(F.silu(gate) * up, self.down_proj.transpose(1, 2))

    def _few(self, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Decode-sized batches (a decode step, a speculative verify), grouped without sorting.
        Most experts busy: every expert over every row, weighted by a dense [T, E] routing
        matrix (reading all weights once beats one small GEMM pair per expert); otherwise only
        the busy experts (batch 1, top-2 of 8: a quarter of the bytes)."""
        k, n_experts = index.shape[1], self.gate_up_proj.shape[0]
        slots_of: dict[int, list[int]] = {}
        for slot, expert in enumerate(index.flatten().tolist()):
            slots_of.setdefault(expert, []).append(slot)
        if 2 * len(slots_of) > n_experts:
            dense = x.new_zeros(x.shape[0], n_experts).scatter_(1, index, weights.to(x.dtype))
            return torch.einsum("te,eth->th", dense, self._batched(x.expand(n_experts, -1, -1)))
        out, flat = torch.zeros_like(x), weights.flatten()
        for expert, slots in slots_of.items():
            if len(slots) == 1:  # a slice: tensor indexing costs half the expert's GEMMs
                rows, weight = slice(slots[0] // k, slots[0] // k + 1), flat[slots[0]]
            else:  # distinct tokens: top-k picks an expert once per token
                rows = torch.tensor([slot // k for slot in slots])
                weight = flat[torch.tensor(slots)][:, None]
            out[rows] += (self._expert(expert, x[rows]) * weight).to(x.dtype)
        return out


class MoE(nn.Module):
    """Router (replicated), routed experts and the shared expert; returns this rank's partial
    sum over every token it is given (the decoder layer sums the ranks' parts)."""

    def __init__(self, config: ModelConfig, parallel: ParallelState | None = None) -> None:
        super().__init__()
        parallel = parallel or ParallelState.single()
        self.gate = Router(config)
        self.experts = Experts(config, parallel)
        shared = config.moe_intermediate_size * config.n_shared_experts
        parts, index = parallel.world, parallel.rank
        self.shared_experts = MLP(config.hidden_size, shared, parts, index) if shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        index, weights = self.gate(x)
        out = self.experts(x, index, weights)
        return out + self.shared_experts(x) if self.shared_experts is not None else out
