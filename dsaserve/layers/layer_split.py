"""LayerSplit (`--enable-dsa-cache-layer-split`): each CP rank keeps the MLA entries of only its
share of the layers; a layer's entries are fetched from their owner when that layer runs.

Layer l (of the main model) is owned by CP rank l mod N; the MTP layer, if any, by every rank.
A rank holds one [slots, entry] tensor per owned layer plus one scratch tensor shared by the
layers it does not own. When a layer runs, after its new entries are written (every rank
computes them: decode rows redundantly, prefill rows all-gathered under CP), the owner
broadcasts the entries of every context slot of the step to the CP group, and the others write
them into the scratch, so the attention reads the same values as with the whole pool.

Per token a rank saves (L - ceil(L / N) - 1) x entry bytes (L main layers); per step it costs,
for every layer, one broadcast of the step's context entries (context tokens x entry bytes) from
the owner to N - 1 ranks. The indexer keys (index_head_dim per indexer layer) stay whole on every
rank. Like SGLang's, it is meant for prefill workers (long chunks over a prefix, few steps).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from dsaserve.distributed.parallel_state import ParallelState
from dsaserve.layers.forward_batch import ForwardBatch


class LayerSplitCache:
    """Stands in for the pool's [layers, slots, entry] tensor: `cache[layer]` is the layer's own
    tensor where this rank owns it, else the shared scratch."""

    def __init__(self, layers: int, main_layers: int, slots: int, dim: int, dtype: torch.dtype,
                 device: torch.device | str, parallel: ParallelState) -> None:  # fmt: skip
        self.parallel = parallel
        self.size = parallel.sizes.cp
        self.rank = parallel.attn_rank % self.size
        self.first = parallel.rank - self.rank  # the CP group's first global rank
        self.main_layers = main_layers
        self.dtype = dtype
        self.shape = (layers, slots, dim)
        mine = [layer for layer in range(layers) if self.owner(layer) in (None, self.rank)]
        self.own = {layer: torch.zeros(slots, dim, dtype=dtype, device=device) for layer in mine}
        self.scratch = torch.zeros(slots, dim, dtype=dtype, device=device)
        self.fetched_bytes = 0  # bytes broadcast or received for fetches (bench, docs)

    def owner(self, layer: int) -> int | None:
        """The CP rank holding `layer`'s entries (None: every rank, the MTP layer)."""
        return layer % self.size if layer < self.main_layers else None

    def __getitem__(self, layer: int) -> torch.Tensor:
        return self.own.get(layer, self.scratch)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in [*self.own.values(), self.scratch])

    def fetch(self, layer: int, batch: ForwardBatch) -> None:
        """Broadcast this step's context entries of `layer` from its owner (all ranks call)."""
        owner = self.owner(layer)
        if owner is None:
            return
        slots = step_slots(batch)
        if slots.numel() == 0:
            return
        cache = self[layer]
        buf = cache.index_select(0, slots) if owner == self.rank else cache.new_empty(
            slots.numel(), cache.shape[1])  # fmt: skip
        start = time.perf_counter()
        torch.distributed.broadcast(buf, self.first + owner, group=self.parallel.cp_group)
        self.parallel.comm_seconds += time.perf_counter() - start
        self.fetched_bytes += buf.numel() * buf.element_size()
        if owner != self.rank:
            cache.index_copy_(0, slots, buf)


def step_slots(batch: ForwardBatch) -> torch.Tensor:
    """Every slot a forward attends: each run's context and the valid decode contexts."""
    parts = [seq.ctx_slots for seq in batch.extends]
    if batch.decode_rows.numel():
        parts.append(batch.decode_slots[batch.decode_valid])
    if not parts:
        return torch.zeros(0, dtype=torch.long)
    return torch.unique(torch.cat(parts))


def fetch_layer(batch: ForwardBatch, layer: int) -> None:
    """After a layer's new entries are written: bring its step's entries from their owner."""
    if isinstance(batch.kv_cache, LayerSplitCache):
        batch.kv_cache.fetch(layer, batch)


def split_kv_cache(args: Any, parallel: ParallelState | None, layers: int, main_layers: int,
                   slots: int, dim: int, dtype, device) -> LayerSplitCache | None:  # fmt: skip
    """The split cache when --enable-dsa-cache-layer-split runs on CP ranks, else None."""
    if args is None or not getattr(args, "enable_dsa_cache_layer_split", False):
        return None
    if parallel is None or parallel.sizes.cp == 1:
        return None
    return LayerSplitCache(layers, main_layers, slots, dim, dtype, device, parallel)
