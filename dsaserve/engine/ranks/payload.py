"""The typed message a group leader broadcasts for one model op: which op, and its inputs.

An op is FORWARD (a ForwardBatch), FORWARD_LOGITS (a ForwardBatch; the forward and then the
logits of its `logits_rows`, in one round), MTP (a ForwardBatch, the hidden states fed to the MTP
layer and an optional reused indexer Selection), LOGITS (hidden rows), EMBED (token ids: a DFlash
drafter's block embeddings), HICACHE (the journal of the leader's HiCache moves, which its group
repeats on its own tiers) or KV_SHARE (pool entries the leader received from a PD prefill, which
its group writes into its own pools). Its tensors travel as two flat buffers: int64 (a shape
header, then every integer/bool tensor) and float (every float tensor, in the model dtype). The
KV pool tensors are never sent (every rank has its own), except the entries a KV_SHARE copies,
as raw bytes in an int64 tensor.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

import torch

from dsaserve.layers.forward_batch import ExtendSeq, ForwardBatch
from dsaserve.layers.indexer import Selection


class Op(IntEnum):
    IDLE = 0
    FORWARD = 1
    MTP = 2
    LOGITS = 3
    STOP = 4
    FORWARD_LOGITS = 5
    EMBED = 6
    HICACHE = 7  # the leader's HiCache moves, repeated by its group (engine/kvcache/moves.py)
    KV_SHARE = 8  # KV the leader received (a PD decode), copied into its group's pools


@dataclass
class OpInputs:
    op: Op
    batch: ForwardBatch | None = None
    hidden: torch.Tensor | None = None
    reuse: Selection | None = None
    # FORWARD: target layers whose outputs the leader's forward also returns (DFlash); the
    # other ranks run the same layers and need nothing of it, so it is not sent
    taps: tuple[int, ...] = ()
    moves: torch.Tensor | None = None  # HICACHE: the journal; KV_SHARE: slots + bytes (int64)

    @property
    def logits_rows(self) -> int:
        """Rows whose logits a FORWARD_LOGITS op returns (0 for the other ops)."""
        if self.op != Op.FORWARD_LOGITS or self.batch is None:
            return 0
        return int(self.batch.logits_rows.shape[0])

    @property
    def rows(self) -> int:
        if self.batch is not None:
            return int(self.batch.input_ids.shape[0])
        return 0 if self.hidden is None else int(self.hidden.shape[0])


_NONE, _INT, _BOOL, _FLOAT = -1, 0, 1, 2


def _tensors(inputs: OpInputs) -> list[torch.Tensor | None]:
    out: list[torch.Tensor | None] = []
    b = inputs.batch
    if b is not None:
        out += [b.input_ids, b.positions, b.out_slots, b.decode_rows, b.decode_slots,
                b.decode_valid, b.logits_rows,
                torch.tensor([[e.q_start, e.q_len] for e in b.extends], dtype=torch.long)
                .reshape(-1, 2)]  # fmt: skip
        out += [e.ctx_slots for e in b.extends]
    if inputs.op in (Op.MTP, Op.LOGITS, Op.EMBED):
        out.append(inputs.hidden)
    if inputs.op in (Op.HICACHE, Op.KV_SHARE):
        out.append(inputs.moves)
    if inputs.op == Op.MTP:
        reuse = inputs.reuse
        out.append(torch.tensor([-1 if reuse is None else len(reuse.extends)]))
        if reuse is not None:
            out += [*reuse.extends, reuse.decode]
    return out


def pack(inputs: OpInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """(ints, floats) buffers on the host."""
    header: list[int] = []
    ints: list[torch.Tensor] = []
    floats: list[torch.Tensor] = []
    for t in _tensors(inputs):
        if t is None:
            header.append(_NONE)
            continue
        t = t.detach().cpu()
        kind = _BOOL if t.dtype == torch.bool else (_FLOAT if t.is_floating_point() else _INT)
        header += [kind, t.dim(), *t.shape]
        (floats if kind == _FLOAT else ints).append(t.reshape(-1))
    head = torch.tensor([len(header), *header], dtype=torch.long)
    int_buf = torch.cat([head, *[t.long() for t in ints]])
    float_dtype = floats[0].dtype if floats else torch.float32
    float_buf = torch.cat(floats) if floats else torch.zeros(0, dtype=float_dtype)
    return int_buf, float_buf


def unpack(op: Op, int_buf: torch.Tensor, float_buf: torch.Tensor, kv_cache: torch.Tensor,
           index_cache: torch.Tensor, device: torch.device) -> OpInputs:  # fmt: skip
    """Rebuild the leader's OpInputs over this rank's own KV pool tensors."""
    n = int(int_buf[0])
    header, pos = int_buf[1 : n + 1].tolist(), n + 1
    fpos, h, tensors = 0, 0, []
    while h < len(header):
        kind = header[h]
        if kind == _NONE:
            tensors.append(None)
            h += 1
            continue
        ndim = header[h + 1]
        shape = header[h + 2 : h + 2 + ndim]
        h += 2 + ndim
        size = 1
        for d in shape:
            size *= d
        if kind == _FLOAT:
            t, fpos = float_buf[fpos : fpos + size].view(shape), fpos + size
        else:
            t, pos = int_buf[pos : pos + size].view(shape), pos + size
            t = t.bool() if kind == _BOOL else t
        tensors.append(t.to(device))
    return _rebuild(op, iter(tensors), kv_cache, index_cache)


def _rebuild(op: Op, tensors, kv_cache, index_cache) -> OpInputs:
    inputs = OpInputs(op)
    if op in (Op.FORWARD, Op.FORWARD_LOGITS, Op.MTP):
        ids, positions, out_slots, decode_rows, decode_slots, valid, logits_rows, ext = (
            next(tensors) for _ in range(8)
        )
        extends = [ExtendSeq(int(s), int(n), next(tensors)) for s, n in ext.tolist()]
        inputs.batch = ForwardBatch(ids, positions, out_slots, extends, decode_rows, decode_slots,
                                    valid, logits_rows, kv_cache, index_cache)  # fmt: skip
    if op in (Op.MTP, Op.LOGITS, Op.EMBED):
        inputs.hidden = next(tensors)
    if op in (Op.HICACHE, Op.KV_SHARE):
        inputs.moves = next(tensors)
    if op == Op.MTP:
        count = int(next(tensors)[0])
        if count >= 0:
            extends = [next(tensors) for _ in range(count)]
            inputs.reuse = Selection(extends, next(tensors))
    return inputs


def empty(op: Op, hidden_size: int, dtype: torch.dtype, kv_cache, index_cache, device) -> OpInputs:
    """The inputs of a group that joins `op` with no tokens of its own (DP attention)."""
    long = torch.zeros(0, dtype=torch.long, device=device)
    hidden = torch.zeros(0, hidden_size, dtype=dtype, device=device)
    if op == Op.LOGITS:
        return OpInputs(op, hidden=hidden)
    if op == Op.EMBED:
        return OpInputs(op, hidden=long)
    if op in (Op.HICACHE, Op.KV_SHARE):
        return OpInputs(op)
    batch = ForwardBatch(long, long, long, [], long, long.view(0, 0),
                         long.view(0, 0).bool(), long, kv_cache, index_cache)  # fmt: skip
    return OpInputs(op, batch=batch, hidden=hidden if op == Op.MTP else None)


def pool_entries(kv_cache: torch.Tensor, index_cache: torch.Tensor,
                 slots: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """KV_SHARE's message: `slots` and their entries in every layer of both pool tensors, as raw
    bytes, in one int64 tensor on the host."""
    dev = kv_cache.device
    parts = [t[:, slots.to(dev)].cpu().contiguous().view(torch.uint8).flatten()
             for t in (kv_cache, index_cache)]  # fmt: skip
    raw = torch.cat([*parts, torch.zeros((-sum(p.numel() for p in parts)) % 8, dtype=torch.uint8)])
    return torch.cat([torch.tensor([slots.numel()]), slots.long().cpu(), raw.view(torch.int64)])


def write_entries(kv_cache: torch.Tensor, index_cache: torch.Tensor, message: torch.Tensor) -> None:
    """Write a `pool_entries` message into this rank's own pool tensors."""
    n = int(message[0])
    slots, raw = message[1 : 1 + n], message[1 + n :].clone().view(torch.uint8)
    start = 0
    for t in (kv_cache, index_cache):
        size = t.shape[0] * n * t.shape[2] * t.element_size()
        part = raw[start : start + size].clone().view(t.dtype).view(t.shape[0], n, t.shape[2])
        t[:, slots.to(t.device)] = part.to(t.device)
        start += size
