"""Masking a batch of logits rows with their requests' grammars (one bitmask, one masked_fill).

Only rows whose grammar is active are filled and masked; the others are left as they are. The
bitmask is filled on the host (the matchers live there) and unpacked on the logits' device.
The fill needs only the tokens sampled so far, so the engine runs `fill_bitmask` in a thread
while the model computes the step's logits (xgrammar and torch both release the GIL) and hands
the result to the sampler: the fill is off the critical path unless it takes longer.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

_BITS = torch.arange(32, dtype=torch.int32)


def constrained_rows(states: list[Any]) -> list[int]:
    """Rows whose next token the grammar decides (states: SamplingState-like, `.grammar`)."""
    return [i for i, s in enumerate(states) if s.grammar is not None and s.grammar.active]


class Filled(NamedTuple):
    rows: list[int]  # the constrained rows of the states it was filled for
    bitmask: torch.Tensor  # int32 [len(rows), ceil(V / 32)]


def fill_bitmask(states: list[Any], vocab: int) -> Filled:
    """The bitmask of the constrained rows of `states` (host memory)."""
    rows = constrained_rows(states)
    bitmask = torch.zeros(len(rows), (vocab + 31) // 32, dtype=torch.int32)
    matchers = [states[i].grammar.matcher for i in rows]
    if matchers and all(type(m) is type(matchers[0]) for m in matchers):
        matchers[0].fill_rows(matchers, bitmask)  # one backend: its (batch) fill
    else:
        for j, matcher in enumerate(matchers):
            matcher.fill_bitmask(bitmask, j)
    return Filled(rows, bitmask)


def apply_grammars(
    logits: torch.Tensor, states: list[Any], rows: list[int], filled: Filled | None = None
) -> None:
    """Set the logits of tokens the grammar forbids to -inf, in place, for `rows` of [B, V];
    `filled` is a bitmask filled ahead for these states (recomputed if its rows differ)."""
    if not rows:
        return
    vocab = logits.shape[1]
    if filled is None or filled.rows != rows or filled.bitmask.shape[1] != (vocab + 31) // 32:
        filled = fill_bitmask(states, vocab)
    allowed = unpack(filled.bitmask.to(logits.device, non_blocking=True), vocab)  # [R, V] bool
    index = torch.tensor(rows, device=logits.device)
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))


def unpack(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """int32 [R, W] -> bool [R, vocab]: bit j of word w is token 32 w + j."""
    bits = _BITS.to(bitmask.device)
    return ((bitmask.unsqueeze(-1) >> bits) & 1).bool().flatten(1)[:, :vocab]
