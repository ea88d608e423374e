"""The ranks' heartbeats, for `/health`: a rank that stops answering is seen in seconds.

Each rank process of node 0 (the engine process is rank 0) runs a thread that writes the time
(CLOCK_MONOTONIC, the same clock in every process of the machine) into its slot of a small file in
the engine's private IPC folder (runtime/ipc.py: 0700, so no other user reads or writes it) every
BEAT_S. The API process reads the file on `/health` and answers 503 when a slot is older than
STALE_S: a stopped (SIGSTOP) or wedged process beats no more, while a rank busy in a long step
still does (the thread runs beside the step; torch and the native decode release the GIL).
The ranks of other nodes count up a key each in the rendezvous store instead (their clocks are
not ours); a thread of rank 0 stamps a rank's slot whenever its count moved. `--watchdog-timeout`
stays what ends the processes.
"""

from __future__ import annotations

import os
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

BEAT_S = 0.5
STALE_S = 3.0
SLOT = struct.Struct("<d")


def start_beating(path: str, rank: int) -> threading.Event:
    """Beat for `rank` from a daemon thread until the process ends or the returned event is set
    (the first rank to beat creates the file; a slot not written yet reads as 0: never)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    return _every(BEAT_S, lambda: os.pwrite(fd, SLOT.pack(time.monotonic()), rank * SLOT.size))


def beat_to_store(store: Any, rank: int) -> threading.Event:
    """A rank of node n > 0: count up its key in the rendezvous store every BEAT_S."""
    return _every(BEAT_S, lambda: store.add(f"heartbeat/{rank}", 1))


def relay_from_store(store: Any, path: str, ranks: range) -> threading.Event:
    """Rank 0: stamp the slot of each of `ranks` (other nodes') whenever its count moved."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    seen: dict[int, int] = {}

    def relay() -> None:
        for rank in ranks:
            count = store.add(f"heartbeat/{rank}", 0)
            if count and count != seen.get(rank):
                seen[rank] = count
                os.pwrite(fd, SLOT.pack(time.monotonic()), rank * SLOT.size)

    return _every(BEAT_S, relay)


def _every(interval: float, work: Callable[[], object]) -> threading.Event:
    """Run `work` every `interval` in a daemon thread until it fails (the store went away with
    the ranks) or the returned event is set."""
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            try:
                work()
            except Exception:
                return
            stop.wait(interval)

    threading.Thread(target=loop, daemon=True, name="dsaserve-heartbeat").start()
    return stop


class Heartbeats:
    """The API process's reader of the heartbeat file (a slot per rank, every node's)."""

    def __init__(self, path: str, ranks: int) -> None:
        self.path, self.ranks = path, ranks

    def late(self, stale_s: float = STALE_S) -> str | None:
        """Which ranks missed their heartbeat, as a sentence (None: every rank is beating)."""
        try:
            with open(self.path, "rb") as f:
                data = f.read(SLOT.size * self.ranks)
        except OSError as e:
            return f"the ranks' heartbeat file cannot be read ({e.strerror})"
        now, late = time.monotonic(), []
        for rank in range(self.ranks):
            offset = rank * SLOT.size
            stamp = SLOT.unpack_from(data, offset)[0] if len(data) >= offset + SLOT.size else 0.0
            if not stamp:
                late.append(f"rank {rank} (never)")
            elif now - stamp > stale_s:
                late.append(f"rank {rank} ({now - stamp:.1f}s ago)")
        return f"no heartbeat from {', '.join(late)}" if late else None
