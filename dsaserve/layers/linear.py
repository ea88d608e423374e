"""Sharded layers. Each sharded parameter carries a `shard` (what slice of the checkpoint tensor
it holds) that the loader reads, so a rank reads only its own slice from the safetensors files.

- `ColumnParallelLinear`: output features split (q_b_proj, kv_b_proj, gate/up projections).
- `RowParallelLinear`: input features split; the caller sums the partial outputs (one
  all-reduce per attention block, one per MLP block).
- `VocabParallelEmbedding` / `ParallelLMHead`: vocabulary split (padded to a multiple of the
  parts; padded rows are zero and their logits are cut off).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class Shard:
    """Part `index` of `parts` along `dim` of the checkpoint tensor (the last part may be short
    when `padded`: the dim is rounded up to a multiple of `parts`)."""

    dim: int
    index: int
    parts: int
    padded: bool = False

    def bounds(self, size: int) -> tuple[int, int, int]:
        """(start, stop, local size) of this part of a dim of `size` (stop clipped to size)."""
        local = -(-size // self.parts) if self.padded else size // self.parts
        start = self.index * local
        return start, min(start + local, size), local


@dataclass(frozen=True)
class ExpertShard:
    """Experts [first, first + count) of the fused expert tensors, each split `inner` inside
    (gate_up_proj: gate and up rows each split; down_proj: columns split)."""

    first: int
    count: int
    inner: Shard


def set_shard(param: nn.Parameter, shard: Shard | ExpertShard | None) -> nn.Parameter:
    if shard is not None and (isinstance(shard, ExpertShard) or shard.parts > 1):
        param.shard = shard  # type: ignore[attr-defined]
    return param


class ColumnParallelLinear(nn.Linear):
    def __init__(self, in_features: int, out_features: int, parts: int = 1, index: int = 0,
                 bias: bool = False) -> None:  # fmt: skip
        super().__init__(in_features, out_features // parts, bias=bias)
        set_shard(self.weight, Shard(0, index, parts))
        if bias:
            set_shard(self.bias, Shard(0, index, parts))


class RowParallelLinear(nn.Linear):
    """y_partial = x_part @ W_part^T (+ bias on part 0 only, so the sum adds it once);
    `reduce` (if given) sums the partials."""

    def __init__(self, in_features: int, out_features: int, parts: int = 1, index: int = 0,
                 bias: bool = False,
                 reduce: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:  # fmt: skip
        super().__init__(in_features // parts, out_features, bias=bias)
        set_shard(self.weight, Shard(1, index, parts))
        self.part_index = index
        self.reduce = reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias if self.part_index == 0 else None
        y = F.linear(x, self.weight, bias)
        return self.reduce(y) if self.reduce is not None else y


class VocabParallelEmbedding(nn.Embedding):
    def __init__(self, vocab: int, hidden: int, parts: int = 1, index: int = 0,
                 reduce: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:  # fmt: skip
        shard = Shard(0, index, parts, padded=True)
        self.start, self.stop, local = shard.bounds(vocab)
        super().__init__(local, hidden)
        set_shard(self.weight, shard)
        self.parts = parts
        self.reduce = reduce

    def reset_parameters(self) -> None:
        """Random values, except on the meta device (the memory fit's model): there `normal_`
        runs through torch's Python refs, whose first use imports torch._dynamo (2 s a process)."""
        if not self.weight.is_meta:
            super().reset_parameters()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.parts == 1:
            return super().forward(ids)
        mine = (ids >= self.start) & (ids < self.stop)
        out = F.embedding((ids - self.start).clamp(0, self.num_embeddings - 1), self.weight)
        out = out * mine[:, None].to(out.dtype)
        return self.reduce(out) if self.reduce is not None else out


class ParallelLMHead(nn.Linear):
    """Vocab-parallel output projection; `gather` joins the parts' logits along the vocab."""

    def __init__(self, hidden: int, vocab: int, parts: int = 1, index: int = 0,
                 gather: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:  # fmt: skip
        shard = Shard(0, index, parts, padded=True)
        local = shard.bounds(vocab)[2]
        super().__init__(hidden, local, bias=False)
        set_shard(self.weight, shard)
        self.vocab = vocab
        self.gather = gather

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        if self.gather is None:
            return y
        return self.gather(y)[..., : self.vocab]
