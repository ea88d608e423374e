"""The forward paths of a step, tried in order: the first that accepts the step runs it.

| path | accepts | built in |
|---|---|---|
| `native` | an all-decode step (every row sampled), the native layers built (CPU) | native.py |
| `native` (ranks) | the same, every rank's native layers built (CPU ranks) | build.py |
| `cuda_graph` | a batch whose rows and context fit a captured bucket (CUDA) | cuda_graph.py |
| `python` / `compiled` | an all-decode batch, on the fused Python forward | fused_step.py |
| `layered` | anything: the model's own layers (one round across ranks) | models/dsa_moe.py |

`build_paths` (build.py's runner) keeps only the paths this engine built; a new path is a class
with `name`, `accepts(step)` and `logits(step)`, put in the list where it should be tried.
"""

from __future__ import annotations

import functools
from typing import Protocol

import torch

from dsaserve.engine.decode.cuda_graph import CudaGraphRunner
from dsaserve.engine.decode.fused_step import DecodeStep
from dsaserve.engine.decode.rows import DecodeRows, all_decodes
from dsaserve.engine.kvcache.pool import KVPool
from dsaserve.engine.ranks.rounds import DistributedModel
from dsaserve.engine.scheduler import ScheduledBatch
from dsaserve.layers.forward_batch import ForwardBatch, forward_context


class Step:
    """One step as the paths see it: the scheduled batch and, built on first use, its
    ForwardBatch and the entries that produce logits (the native path never needs them)."""

    def __init__(self, scheduled: ScheduledBatch, all_rows: bool, build) -> None:
        self.scheduled, self.all_rows, self._build = scheduled, all_rows, build

    @functools.cached_property
    def built(self) -> tuple[ForwardBatch, list[int]]:
        batch, sampled = self._build(self.scheduled)
        if self.all_rows:
            batch.logits_rows = torch.arange(
                batch.input_ids.shape[0], device=batch.positions.device
            )
        return batch, sampled


class DecodePath(Protocol):
    name: str

    def accepts(self, step: Step) -> bool: ...

    def logits(self, step: Step) -> tuple[list[int], torch.Tensor]:
        """(the entries that produced logits, their logits [R, V])."""


class NativePath:
    """The native layers from the batch kept across steps (rows.py): no ForwardBatch built."""

    def __init__(self, step: DecodeStep, pool: KVPool) -> None:
        self.name, self.step, self.pool, self.rows = "native", step, pool, DecodeRows()

    def accepts(self, step: Step) -> bool:
        return not step.all_rows and all_decodes(step.scheduled)

    def logits(self, step: Step) -> tuple[list[int], torch.Tensor]:
        scheduled = step.scheduled
        ids, positions, slots = self.rows.inputs(scheduled)
        logits = self.step.fused.decode_logits(ids, positions, slots, self.pool.kv_cache,
                                               self.pool.index_cache,
                                               max(scheduled.starts))  # fmt: skip
        return list(range(len(scheduled.reqs))), logits


class RanksNativePath:
    """An all-decode step as one FORWARD_LOGITS round, which every rank runs on its native
    layers (engine/ranks/rounds.py `RankRunner._native`)."""

    def __init__(self, model: DistributedModel) -> None:
        self.name, self.model = "native", model

    def accepts(self, step: Step) -> bool:
        return not step.all_rows and all_decodes(step.scheduled)

    def logits(self, step: Step) -> tuple[list[int], torch.Tensor]:
        batch, sampled = step.built
        with forward_context(batch):
            return sampled, self.model.forward_logits()


class GraphPath:
    """A captured CUDA graph's replay (it installs its own static batch)."""

    def __init__(self, graphs: CudaGraphRunner, model) -> None:
        self.name, self.graphs, self.model = "cuda_graph", graphs, model

    def accepts(self, step: Step) -> bool:
        return self.graphs.accepts(step.built[0])

    def logits(self, step: Step) -> tuple[list[int], torch.Tensor]:
        batch, sampled = step.built
        return sampled, self.model.logits(self.graphs(batch)[batch.logits_rows])


class FusedPath:
    """The fused Python decode forward (optionally compiled)."""

    def __init__(self, step: DecodeStep) -> None:
        self.name = "compiled" if step.compiled else "python"
        self.step = step

    def accepts(self, step: Step) -> bool:
        return self.step.accepts(step.built[0])

    def logits(self, step: Step) -> tuple[list[int], torch.Tensor]:
        batch, sampled = step.built
        with forward_context(batch):
            logits = self.step(batch)
        rows = batch.logits_rows
        return sampled, logits if rows.numel() == logits.shape[0] else logits[rows]


class LayeredPath:
    """The model's own layers: every step it is given (with ranks, one round across them)."""

    def __init__(self, model) -> None:
        self.name, self.model = "layered", model

    def accepts(self, step: Step) -> bool:
        return True

    def logits(self, step: Step) -> tuple[list[int], torch.Tensor]:
        batch, sampled = step.built
        with forward_context(batch):
            return sampled, self.model.forward_logits()


def build_paths(model, pool: KVPool, decode_step: DecodeStep | None,
                graphs: CudaGraphRunner | None) -> list[DecodePath]:  # fmt: skip
    """The paths this engine built, in the order they are tried."""
    paths: list[DecodePath] = []
    if decode_step is not None and decode_step.native is not None:
        paths.append(NativePath(decode_step, pool))
    if isinstance(model, DistributedModel) and model.native:
        paths.append(RanksNativePath(model))
    if graphs is not None:
        paths.append(GraphPath(graphs, model))
    if decode_step is not None:
        paths.append(FusedPath(decode_step))
    return [*paths, LayeredPath(model)]
