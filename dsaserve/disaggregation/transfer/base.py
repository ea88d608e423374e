"""`TransferEngine`: one-sided writes of registered host/device memory into a peer's.

Both roles create one and register their buffers (KV pool, aux). The decode sends its
`metadata()` to the prefill, which calls `add_peer` once and then `write`s segments straight into
the decode's memory; `write` returns when the bytes are in place (or raises `TransferError`).
`notifications()` lists the notification tags that arrived (NIXL delivers one per write); backends
without them return the tags of nothing and set `notifies = False`.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Callable

Segment = tuple[int, int, int]  # (local address, remote address, bytes)
Kinds = tuple[str, str]  # memory kinds of the local and remote side: "DRAM" (host) or "VRAM"
HOST: Kinds = ("DRAM", "DRAM")

BACKENDS = {
    "nixl": "dsaserve.disaggregation.transfer.nixl:NixlEngine",
    "mooncake": "dsaserve.disaggregation.transfer.mooncake:MooncakeEngine",
}
# The fault-injection seam: None in production. A test installs a callable in the server's
# processes (tests/pd_faults.py) that runs before every write, given the write's tag, and may
# raise `TransferError` or wait. With a hook installed the prefill writes a room's KV (tag b"")
# before its aux record (tag: the room id), so a hook that waits on a room's tag stands between
# the two (without one, host memory on both sides goes in a single write).
WRITE_HOOK: Callable[[bytes], None] | None = None


class TransferError(RuntimeError):
    """A write that did not complete (peer gone, memory not registered, backend error)."""


class TransferEngine(ABC):
    name: str = ""
    notifies: bool = False

    @abstractmethod
    def register(self, regions: list[tuple[int, int, str]]) -> None:
        """Register (address, bytes, kind) regions; kind "DRAM" (host) or "VRAM" (GPU)."""

    @abstractmethod
    def metadata(self) -> bytes:
        """What a peer passes to `add_peer` to reach this engine."""

    @abstractmethod
    def add_peer(self, metadata: bytes) -> str:
        """Connect to a peer; return its handle for `write`."""

    @abstractmethod
    def _write(self, peer: str, segments: list[Segment], tag: bytes, kinds: Kinds) -> None: ...

    def write(self, peer: str, segments: list[Segment], tag: bytes, kinds: Kinds = HOST) -> None:
        if WRITE_HOOK is not None:
            WRITE_HOOK(tag)
        if segments:
            self._write(peer, segments, tag, kinds)

    def notifications(self) -> list[bytes]:
        return []

    def remove_peer(self, peer: str) -> None:  # noqa: B027 (optional)
        pass

    def close(self) -> None:  # noqa: B027 (optional)
        pass


def create(backend: str, agent_name: str, host: str, ib_device: str | None) -> TransferEngine:
    """The engine for `--disaggregation-transfer-backend`; ImportError says what to install."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown transfer backend {backend!r}; choose one of {sorted(BACKENDS)}")
    module, cls = BACKENDS[backend].split(":")
    return getattr(importlib.import_module(module), cls)(agent_name, host, ib_device)
