"""HiCache's byte moves on one rank's tiers, and the journal that repeats them on its group.

`TierMoves` copies pages between this rank's device pool, its host pool and its storage tier:
device -> host, host -> device, storage -> device (pages a prefetch read), host -> storage. In a
single process that is all. With `--tp N` every rank of an attention group has a pool of the same
layout holding the same bytes (the MLA entry and the indexer keys are replicated, docs/parallel.md)
and keeps its own host and storage tiers; the group leader's tree (hicache.py) decides
every move, does it on its own tiers and records it in a journal of int64s. Before the next
model op (or heartbeat, or STOP) the leader sends the journal to its group in one HICACHE round
(ranks/rounds.py), and each other rank replays it on its own tiers, in order: so a device page
is copied out before any forward writes it again, and loaded before any forward reads it. No KV
byte travels between ranks.

Storage: each rank has its own files (its identity includes its rank and the layout,
engine/kvcache/build.py). A page's key on a follower is the SHA-256 of the follower's identity
and the leader's key for it, so the journal carries the leader's keys (32 bytes a page) and two
ranks, layouts or checkpoints never read each other's pages. A follower that cannot read a page
its leader read (its files damaged) raises: its rank ends and the server fails fast.
"""

from __future__ import annotations

import hashlib
from enum import IntEnum

import torch

from dsaserve.engine.kvcache.codec import PageTensors
from dsaserve.engine.kvcache.pool import KVPool, PagePool, page_slots
from dsaserve.engine.kvcache.storage import StorageTier

KEY_INTS = 4  # a SHA-256 key as int64s


class Move(IntEnum):
    D2H = 1  # n, device pages, host pages
    H2D = 2  # n, host pages, device pages
    LOAD = 3  # n, device pages, keys: pages read from storage
    STORE = 4  # n, host pages, keys: host pages written to storage (when not there yet)


class HostKVPool:
    """The host tier: tensors shaped like the device pool's, over its own pages."""

    def __init__(self, device_pool: KVPool, num_pages: int) -> None:
        self.page_size = device_pool.page_size
        self.pages = PagePool(num_pages)
        slots = num_pages * self.page_size
        pin = device_pool.kv_cache.is_cuda
        kv, index = device_pool.kv_cache, device_pool.index_cache
        self.kv_cache = torch.zeros(kv.shape[0], slots, kv.shape[2], dtype=kv.dtype, pin_memory=pin)
        self.index_cache = torch.zeros(index.shape[0], slots, index.shape[2], dtype=index.dtype,
                                       pin_memory=pin)  # fmt: skip


class TierMoves:
    """One rank's page moves. `record`: this is a group leader with other ranks (keep the
    journal); `leader_keys`: this is a follower (its storage keys derive from the leader's)."""

    def __init__(self, pool: KVPool, host: HostKVPool, storage: StorageTier | None,
                 record: bool = False, leader_keys: bool = False) -> None:  # fmt: skip
        self.pool, self.host, self.storage = pool, host, storage
        self.page_size = pool.page_size
        self.record, self.leader_keys = record, leader_keys
        self.journal: list[torch.Tensor] = []

    # ---- the moves ----------------------------------------------------------------------------
    def d2h(self, device_pages: list[int], host_pages: list[int]) -> None:
        ds, hs = self._slots(device_pages), self._slots(host_pages)
        dev = self.pool.kv_cache.device
        self.host.kv_cache[:, hs] = self.pool.kv_cache[:, ds.to(dev)].cpu()
        self.host.index_cache[:, hs] = self.pool.index_cache[:, ds.to(dev)].cpu()
        self._note(Move.D2H, device_pages, host_pages)

    def h2d(self, host_pages: list[int], device_pages: list[int]) -> None:
        hs = self._slots(host_pages)
        self._to_device(device_pages, self.host.kv_cache[:, hs], self.host.index_cache[:, hs])
        self._note(Move.H2D, host_pages, device_pages)

    def load(self, device_pages: list[int], pages: list[PageTensors], keys: list[str]) -> None:
        """Pages read from storage (by the leader's prefetch, under `keys`) onto the device."""
        kv = torch.cat([p.kv for p in pages], dim=1)  # [layers, pages * page_size, dim]
        index = torch.cat([p.index for p in pages], dim=1)
        self._to_device(device_pages, kv, index)
        self._note(Move.LOAD, device_pages, keys=keys)

    def store(self, host_pages: list[int], keys: list[str]) -> None:
        """Write these host pages to storage under `keys` (those not there yet), in the
        background."""
        for key, host_page in zip(keys, host_pages):
            if not self.storage.exists(key):
                self.storage.write_async(key, self.host_page(host_page))
        self._note(Move.STORE, host_pages, keys=keys)

    def host_page(self, host_page: int) -> PageTensors:
        """A copy of one host page's tensors (what storage receives; indexing copies)."""
        hs = self._slots([host_page])
        return PageTensors(self.host.kv_cache[:, hs], self.host.index_cache[:, hs])

    def _to_device(self, device_pages: list[int], kv: torch.Tensor, index: torch.Tensor) -> None:
        dev = self.pool.kv_cache.device
        ds = self._slots(device_pages).to(dev)
        self.pool.kv_cache[:, ds] = kv.to(dev, non_blocking=True)
        self.pool.index_cache[:, ds] = index.to(dev, non_blocking=True)

    def _slots(self, pages: list[int]) -> torch.Tensor:
        return page_slots(pages, self.page_size)

    # ---- the journal ---------------------------------------------------------------------------
    def _note(self, move: Move, first: list[int], second: list[int] = (),
              keys: list[str] = ()) -> None:  # fmt: skip
        if not self.record:
            return
        head = torch.tensor([int(move), len(first), *first, *second], dtype=torch.long)
        self.journal += [head, *(_key_ints(k) for k in keys)]

    def take_journal(self) -> torch.Tensor | None:
        """The moves since the last call, as one int64 tensor (None: nothing moved)."""
        if not self.journal:
            return None
        journal, self.journal = torch.cat(self.journal), []
        return journal

    def replay(self, journal: torch.Tensor) -> None:
        """A follower: the leader's moves, in order, on this rank's own tiers."""
        values, pos = journal.tolist(), 0
        while pos < len(values):
            move, n = Move(values[pos]), values[pos + 1]
            first, pos = values[pos + 2 : pos + 2 + n], pos + 2 + n
            if move in (Move.D2H, Move.H2D):
                second, pos = values[pos : pos + n], pos + n
                (self.d2h if move == Move.D2H else self.h2d)(first, second)
                continue
            keys = [self._own_key(journal[pos + KEY_INTS * i :][:KEY_INTS]) for i in range(n)]
            pos += KEY_INTS * n
            if move == Move.STORE:
                self.store(first, keys)
            else:
                self.load(first, [self._read(key) for key in keys], keys)

    def finish(self) -> None:
        """This rank is leaving: its storage writes land first (bounded)."""
        if self.storage is not None:
            self.storage.finish()

    def _own_key(self, leader_key: torch.Tensor) -> str:
        key = leader_key.numpy().tobytes().hex()
        identity = self.storage.codec.identity if self.storage is not None else ""
        return hashlib.sha256(f"{identity}:{key}".encode()).hexdigest() if self.leader_keys else key

    def _read(self, key: str) -> PageTensors:
        page = self.storage.read(key)
        if page is None:  # still in this rank's write queue?
            self.storage.drain()
            page = self.storage.read(key)
        if page is None:
            raise RuntimeError(f"HiCache storage: this rank cannot read page {key[:16]}, which "
                               "its group leader loaded (its files are damaged)")  # fmt: skip
        return page


def _key_ints(key: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(bytes.fromhex(key)), dtype=torch.int64).clone()
