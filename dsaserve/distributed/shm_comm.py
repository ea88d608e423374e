"""Shared-memory collectives for the CPU ranks of one node (SGLang's and vLLM's CPU TP do the same).

Why: gloo's TCP all-reduce costs about 0.5 ms when both ranks arrive together and 3 ms or more
when they do not (each wait is a blocking read and a wake-up), and a decode step runs two per
layer. Here the ranks of a group map one file under /dev/shm (unlinked as soon as every rank has
mapped it, so nothing is left behind even after kill -9; 0600, so no other user maps it):

- a flag per rank, each on its own cache line: the sequence number of the last message it wrote,
  and beside it (one word per data area) that message's size: every rank checks that all ranks
  sent the same size, so ranks out of step (one reducing a padded batch, another the real
  rows: what NCCL would hang on) fail at once instead of summing misaligned bytes;
- two data areas (used alternately), each with one slot of `SLOT_BYTES` per rank.

A collective writes this rank's part into its slot, publishes the sequence number, waits until
every rank has published it, then reads every slot; a tensor larger than a slot goes through in
slot-sized chunks. Two areas make this safe without a second barrier: a rank that writes area
`seq % 2` has seen every flag reach `seq - 1`, which each rank publishes only after it has read
the area's previous message (`seq - 2`). Every rank sums the slots in rank order, so the result
is bit-identical on every rank. The ordering relies on x86's total store order (data stores
before the flag store, flag loads before data loads), so the path is used on x86-64 only;
elsewhere, and across nodes, the collectives stay on gloo.

The wait spins briefly, then yields the core (more ranks than cores: the rank it waits for may
need this one), then sleeps in steps growing to 2 ms (a follower waiting for an idle leader's
next round costs next to no CPU), and raises after `timeout` seconds (the watchdog). The rank
rounds' op headers and payloads (`rounds.py`) and the model's all-reduces and all-gathers use it.
"""

from __future__ import annotations

import os
import platform
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

SLOT_BYTES = 1 << 20  # one rank's share of one message chunk
FLAG_STRIDE = 16  # int64s per flag: one 128-byte line each
SPIN = 2000  # flag polls before the wait starts yielding the core
YIELD_S = 0.005  # ... and seconds of yielding before it sleeps between polls,
MAX_SLEEP_S = 0.002  # for 5% of the time waited so far, at most this (an idle server's ranks)


def supported(device_type: str, nnodes: int) -> bool:
    """Shared memory holds for CPU ranks on one node, with x86's store ordering."""
    return device_type == "cpu" and nnodes == 1 and platform.machine() in ("x86_64", "AMD64")


def _shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


class ShmGroup:
    """The shared-memory collectives of one group of ranks (`ranks`, this process among them)."""

    def __init__(self, path: str, ranks: list[int], rank: int, timeout: float) -> None:
        self.size = len(ranks)
        self.index = ranks.index(rank)
        self.timeout = timeout
        flag_bytes = self.size * FLAG_STRIDE * 8
        total = flag_bytes + 2 * self.size * SLOT_BYTES
        self.memory = torch.from_file(path, shared=True, size=total, dtype=torch.uint8)
        words = self.memory[:flag_bytes].view(torch.int64).numpy()
        self.flags = words[::FLAG_STRIDE]
        self.sizes = [words[1::FLAG_STRIDE], words[2::FLAG_STRIDE]]  # per data area
        self.data = self.memory[flag_bytes:].view(2, self.size, SLOT_BYTES)
        self.seq = 0
        self.wait_seconds = 0.0

    @classmethod
    def create(cls, ranks: list[int], rank: int, group: Any, timeout: float) -> ShmGroup:
        """Every rank of `ranks` calls this together; `group` is their gloo group (world when
        None). The first rank creates the file, every rank maps it, then it is unlinked."""
        holder: list[Any] = [None]
        if rank == ranks[0]:
            path = Path(_shm_dir()) / f"dsaserve-{os.getpid()}-{uuid.uuid4().hex[:12]}"
            size = len(ranks) * FLAG_STRIDE * 8 + 2 * len(ranks) * SLOT_BYTES
            with os.fdopen(os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600), "wb") as f:
                f.truncate(size)  # zeros: every flag starts at sequence 0; this user's alone
            holder[0] = str(path)
        dist.broadcast_object_list(holder, src=ranks[0], group=group)
        try:
            shm = cls(holder[0], ranks, rank, timeout)
        finally:
            dist.barrier(group=group)  # every rank has mapped it (or failed): unlink
            if rank == ranks[0]:
                Path(holder[0]).unlink(missing_ok=True)
        return shm

    # ---- collectives ----------------------------------------------------------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the group, in place (every rank gets the same bits)."""
        flat = x.view(-1) if x.is_contiguous() else x.contiguous().view(-1)
        for part in self._chunks(flat):
            slots = self._exchange(part)
            torch.add(slots[0], slots[1], out=part)
            for slot in slots[2:]:
                part.add_(slot)
        if flat.data_ptr() != x.data_ptr():
            x.copy_(flat.view_as(x))
        return x

    def broadcast(self, x: torch.Tensor, src: int) -> torch.Tensor:
        """Group rank `src`'s x into every rank's x (same shape and dtype), in place."""
        flat = x.view(-1) if x.is_contiguous() else x.contiguous().view(-1)
        for part in self._chunks(flat):
            slots = self._exchange(part, write=self.index == src)
            if self.index != src:
                part.copy_(slots[src])
        if flat.data_ptr() != x.data_ptr():
            x.copy_(flat.view_as(x))
        return x

    def all_gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's x (same shape and dtype on every rank), in rank order."""
        flat = x.contiguous().view(-1)
        out = [torch.empty_like(flat) for _ in range(self.size)]
        start = 0
        for part in self._chunks(flat):
            slots = self._exchange(part)
            for dst, slot in zip(out, slots):
                dst[start : start + part.numel()].copy_(slot)
            start += part.numel()
        return [t.view_as(x) for t in out]

    # ---- the exchange ---------------------------------------------------------------------
    def _chunks(self, flat: torch.Tensor) -> list[torch.Tensor]:
        per = SLOT_BYTES // flat.element_size()
        return [flat[i : i + per] for i in range(0, flat.numel(), per)] or [flat]

    def _exchange(self, part: torch.Tensor, write: bool = True) -> list[torch.Tensor]:
        """Publish `part` (at most a slot; with `write` False only the sequence number); return
        every rank's part as views of the slots."""
        self.seq += 1
        area = self.data[self.seq % 2]
        nbytes = part.numel() * part.element_size()
        slots = [area[r, :nbytes].view(part.dtype) for r in range(self.size)]
        if write:
            slots[self.index].copy_(part)
        sizes = self.sizes[self.seq % 2]
        sizes[self.index] = nbytes
        self.flags[self.index] = self.seq
        self._wait(self.seq)
        if (sizes != nbytes).any():
            raise RuntimeError(f"shared-memory collective: the group's ranks sent {sizes.tolist()} "
                               "bytes for one message (ranks out of step)")  # fmt: skip
        return slots

    def _wait(self, seq: int) -> None:
        flags = self.flags
        if flags.min() >= seq:
            return
        start = time.perf_counter()
        polls = 0
        while flags.min() < seq:
            polls += 1
            if polls < SPIN:
                continue
            waited = time.perf_counter() - start
            if waited > self.timeout:
                late = [r for r in range(self.size) if flags[r] < seq]
                raise TimeoutError(f"shared-memory collective: group ranks {late} did not "
                                   f"arrive within {self.timeout:g}s")  # fmt: skip
            if waited < YIELD_S:
                os.sched_yield()
            else:
                time.sleep(min(MAX_SLEEP_S, 0.05 * waited))
        self.wait_seconds += time.perf_counter() - start
