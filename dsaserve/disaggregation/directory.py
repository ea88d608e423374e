"""The decode's view of its prefills: each bootstrap address resolved to the ZMQ endpoint of every
attention group of the prefill (`GET /route`: the layout, then rank (g, 0, 0, 0) for each group g
of its `dp_size`; a room is prefilled by group `room % dp_size`, SGLang's
`follow_bootstrap_room`), then watched by a heartbeat (`GET /health` every
`--disaggregation-heartbeat-interval` seconds; `SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE`
misses, default 2, mark it lost). A lost prefill that answers again is resolved afresh (a restart
has a new session, so the decode registers again). All network calls run in one thread.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, replace

from dsaserve.cluster.addresses import tcp_endpoint
from dsaserve.disaggregation import bootstrap

ALL_RANKS = (-1, -1, -1, -1)
MAX_GROUPS = 256  # attention groups of one prefill


@dataclass
class Prefill:
    endpoints: tuple[str, ...] = ()  # each attention group's tcp://rank_ip:rank_port, resolved
    session: str | None = None
    lost: str | None = None  # why it is considered gone
    failures: int = 0
    last_check: float = 0.0
    answered_at: float = 0.0  # when the last look at it (resolve or heartbeat) ended

    def endpoint(self, room: int) -> str | None:
        """The ZMQ endpoint of the group that prefills `room` (None until resolved)."""
        return self.endpoints[room % len(self.endpoints)] if self.endpoints else None


class PrefillDirectory:
    def __init__(self, interval: float, secret: str | None,
                 max_failures: int | None = None) -> None:  # fmt: skip
        env = os.environ.get("SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE")
        self.max_failures = max(max_failures or int(env or 2), 1)
        self.interval = interval
        self.secret = secret
        self.entries: dict[str, Prefill] = {}
        self.lock = threading.Lock()
        self.wake = threading.Event()
        self.stopped = False
        threading.Thread(target=self._run, daemon=True, name="pd-directory").start()

    def want(self, address: str) -> None:
        with self.lock:
            entry = self.entries.setdefault(address, Prefill())
            if not entry.endpoints:  # new, or lost: look (again) now
                self.wake.set()

    def get(self, address: str) -> Prefill:
        with self.lock:
            entry = self.entries.get(address) or Prefill()
            return replace(entry)

    def close(self) -> None:
        self.stopped = True
        self.wake.set()

    def _run(self) -> None:
        while not self.stopped:
            self.wake.wait(min(self.interval, 0.5))
            self.wake.clear()
            with self.lock:
                addresses = list(self.entries)
            for address in addresses:
                self._check(address)

    def _check(self, address: str) -> None:
        entry = self.entries[address]
        now = time.monotonic()
        if entry.endpoints and now - entry.last_check < self.interval:
            return
        entry.last_check = now
        if not entry.endpoints:
            return self._resolve(address, entry)
        if bootstrap.healthy(address):
            entry.failures = 0
            return
        self._missed(entry, f"the prefill's bootstrap server {address} stopped answering")

    def _resolve(self, address: str, entry: Prefill) -> None:
        try:
            info = bootstrap.query_route(address, ALL_RANKS, self.secret)
            groups = int(info.get("dp_size", 1))
            if not 1 <= groups <= MAX_GROUPS:
                raise ValueError(f"dp_size {groups} is out of range")
            endpoints = []
            for group in range(groups):
                rank = bootstrap.query_route(address, (group, 0, 0, 0), self.secret)
                endpoints.append(tcp_endpoint(str(rank["rank_ip"]), int(rank["rank_port"])))
        except (OSError, RuntimeError, ValueError, KeyError, TypeError) as e:
            self._missed(entry, f"cannot reach the prefill's bootstrap server {address}: {e}")
            return
        with self.lock:
            entry.endpoints = tuple(endpoints)
            entry.session = str(info.get("dsaserve_session"))
            entry.lost, entry.failures = None, 0
            entry.answered_at = time.monotonic()

    def _missed(self, entry: Prefill, reason: str) -> None:
        with self.lock:
            entry.failures += 1
            entry.answered_at = time.monotonic()
            if entry.failures >= self.max_failures:
                entry.lost = reason
                entry.endpoints = ()  # resolve again if it comes back
