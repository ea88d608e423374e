"""`ForwardBatch`: what one model forward computes, installed for the layers by a context manager.

Tokens of all requests are flattened into one row dimension T. Requests whose step computes one
token (decodes), and the short speculative runs (verify, catch-up: one decode row per token, each
over its own prefix), are attended in one padded, batched pass; prefill chunks are attended one
sequence at a time.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from dsaserve.kernels.registry import DEFAULT_KERNELS, Kernels


@dataclass
class ExtendSeq:
    """A run of q_len new tokens at rows [q_start, q_start + q_len) over a context of ctx_len."""

    q_start: int
    q_len: int
    ctx_slots: torch.Tensor  # [ctx_len] KV slots of the whole context, new tokens last

    @property
    def ctx_len(self) -> int:
        return self.ctx_slots.shape[0]


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    out_slots: torch.Tensor  # [T] where each new token's KV is written
    extends: list[ExtendSeq]
    decode_rows: torch.Tensor  # [Bd] rows of single-token requests
    decode_slots: torch.Tensor  # [Bd, Lmax] context slots, padded with 0
    decode_valid: torch.Tensor  # [Bd, Lmax] bool
    logits_rows: torch.Tensor  # [R] rows whose next-token logits are needed
    kv_cache: torch.Tensor  # [layers, slots, kv_lora_rank + rope] the pool's MLA entries
    index_cache: torch.Tensor  # [indexer layers, slots, index_head_dim]
    kernels: Kernels = field(default=DEFAULT_KERNELS)  # the backend of each hot op


def gather_rows(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """cache[slots] for slots of any shape (index_select is several times faster on CPU)."""
    return cache.index_select(0, slots.reshape(-1)).view(*slots.shape, cache.shape[-1])


_current: list[ForwardBatch] = []


@contextmanager
def forward_context(batch: ForwardBatch) -> Iterator[ForwardBatch]:
    """Install `batch` for the layers of one forward; nesting is refused."""
    if _current:
        raise RuntimeError("a forward batch is already installed")
    _current.append(batch)
    try:
        yield batch
    finally:
        _current.pop()


def current_batch() -> ForwardBatch:
    if not _current:
        raise RuntimeError("no forward batch installed: call the model inside forward_context()")
    return _current[0]


def installed(batch: ForwardBatch) -> Any:
    """Install `batch`: the context of a forward, or, inside one (a group leader waiting in its
    own forward for its turn in the rank rounds), in place of the batch installed there."""
    return swapped_batch(batch) if _current else forward_context(batch)


@contextmanager
def swapped_batch(batch: ForwardBatch) -> Iterator[ForwardBatch]:
    """Replace the installed batch for a while: a DP-attention group leader, waiting inside its
    own forward for its turn, runs another group's op with no tokens of its own."""
    if not _current:
        raise RuntimeError("no forward batch installed to swap")
    saved, _current[0] = _current[0], batch
    try:
        yield batch
    finally:
        _current[0] = saved
