"""`TransferEngine`: one-sided writes of registered host/device memory into a peer's.

Both roles create one and register their buffers (KV pool, aux). The decode sends its
`metadata()` to the prefill, which calls `add_peer` once and then `write`s segments straight into
the decode's memory; `write` returns when the bytes are in place (or raises `TransferError`).
`notifications()` lists the notification tags that arrived (NIXL delivers one per write); backends
without them return the tags of nothing and set `notifies = False`.
"""

from __future__ import annotations

import importlib
import os
import time
from abc import ABC, abstractmethod

Segment = tuple[int, int, int]  # (local address, remote address, bytes)
Kinds = tuple[str, str]  # memory kinds of the local and remote side: "DRAM" (host) or "VRAM"
HOST: Kinds = ("DRAM", "DRAM")

BACKENDS = {
    "nixl": "dsaserve.disaggregation.transfer.nixl:NixlEngine",
    "mooncake": "dsaserve.disaggregation.transfer.mooncake:MooncakeEngine",
}
# Test hooks (fault injection), read once at start: off in production unless one of the variables
# is set. DSASERVE_PD_FAULT names a fixed mode; DSASERVE_PD_FAULT_FILE a file a test rewrites to
# switch modes on a running server. "transfer": every write fails. "pause": a room's KV and aux
# go in separate writes, and between them the writer writes "PID ROOM" to FILE.paused and waits
# until the mode changes (a test kills it there, or releases it).
FAULT_ENV = "DSASERVE_PD_FAULT"
FAULT_FILE_ENV = "DSASERVE_PD_FAULT_FILE"
_FAULT = os.environ.get(FAULT_ENV, "")
_FAULT_FILE = os.environ.get(FAULT_FILE_ENV, "")
PAUSE_POLL_S = 0.05


def fault_mode() -> str:
    if not _FAULT_FILE:
        return _FAULT
    try:
        with open(_FAULT_FILE) as f:
            return f.read().strip()
    except OSError:
        return ""


def pause_between_writes(room: int) -> None:
    """Mode "pause": say that this process wrote the room's KV but not its aux, then wait until
    the mode changes (the marker lets a test act at exactly this point instead of sleeping)."""
    with open(_FAULT_FILE + ".paused", "w") as f:
        f.write(f"{os.getpid()} {room}")
    while fault_mode() == "pause":
        time.sleep(PAUSE_POLL_S)


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
        if fault_mode() == "transfer":
            raise TransferError("fault injection: the transfer engine is broken on purpose")
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
