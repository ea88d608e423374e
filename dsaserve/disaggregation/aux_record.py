"""The "aux" data of a room: the first sampled token and its logprob (with top alternatives),
one fixed-size record per slot of a registered uint8 buffer that the prefill writes into."""

from __future__ import annotations

import struct

import torch

from dsaserve.engine.messages import TokenLogprob

MAX_TOP = 20
_HEAD = struct.Struct("<qdii")  # token, logprob, has_logprob, number of top entries
_TOP = struct.Struct("<qd")
ITEM_BYTES = 512  # >= _HEAD.size + MAX_TOP * _TOP.size (344)


def buffer(num_slots: int) -> torch.Tensor:
    return torch.zeros(num_slots, ITEM_BYTES, dtype=torch.uint8)


def pack(into: torch.Tensor, index: int, token: int, logprob: TokenLogprob | None) -> None:
    top = list(logprob.top[:MAX_TOP]) if logprob is not None else []
    value = logprob.logprob if logprob is not None else 0.0
    data = _HEAD.pack(token, value, int(logprob is not None), len(top))
    data += b"".join(_TOP.pack(t, p) for t, p in top)
    row = torch.zeros(ITEM_BYTES, dtype=torch.uint8)
    row[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    into[index] = row


def unpack(buf: torch.Tensor, index: int, vocab: int) -> tuple[int, TokenLogprob | None]:
    """The record at `index`; ValueError when it names a token outside [0, vocab)."""
    data = buf[index].numpy().tobytes()
    token, value, has_logprob, n_top = _HEAD.unpack_from(data)
    if not 0 <= n_top <= MAX_TOP:
        raise ValueError(f"{n_top} top logprobs (at most {MAX_TOP})")
    top = [_TOP.unpack_from(data, _HEAD.size + i * _TOP.size) for i in range(n_top)]
    if any(not 0 <= t < vocab for t in [token, *(t for t, _ in top)]):
        raise ValueError(f"a token id outside the vocabulary of {vocab}")
    if not has_logprob:
        return token, None
    return token, TokenLogprob(token, value, [(int(t), float(p)) for t, p in top])


class SlotPool:
    """Free aux slots."""

    def __init__(self, num_slots: int) -> None:
        self.free = list(range(num_slots - 1, -1, -1))

    def take(self) -> int | None:
        return self.free.pop() if self.free else None

    def give(self, index: int) -> None:
        self.free.append(index)
