"""What both roles share: the wrapper around an `Engine`, ZMQ sockets, counters, failures."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any

import zmq

from dsaserve.args import ServerArgs
from dsaserve.disaggregation import aux, kv_regions
from dsaserve.disaggregation.transfer import create
from dsaserve.engine.io import RequestOutput
from dsaserve.engine.request import Req

# reject(rids, message, http status): refuse requests whose KV cannot arrive (API error shape)
Reject = Callable[[list[str], str, int], None]
IDLE_WAIT_MS = 5


class RoleEngine:
    """An `Engine` with one disaggregation role in front; the engine loop drives it unchanged."""

    role = ""

    def __init__(self, engine: Any, args: ServerArgs, reject: Reject, aux_slots: int) -> None:
        self.engine = engine
        self.args = args
        self.reject = reject
        self.context = zmq.Context()
        self.inbox = self.context.socket(zmq.PULL)
        port = self.inbox.bind_to_random_port(f"tcp://{args.host}")
        self.endpoint = f"tcp://{args.host}:{port}"
        self.rank_port = port
        self.outboxes: dict[str, zmq.Socket] = {}
        self.session = uuid.uuid4().hex[:12]
        self.aux = aux.buffer(aux_slots)
        pool = engine.pool
        self.layout = kv_regions.describe(pool, engine.with_mtp, self.aux)
        self.agent_name = f"dsaserve-{self.role}-{self.session}"
        backend = args.disaggregation_transfer_backend
        self.transfer = create(backend, self.agent_name, args.host, args.disaggregation_ib_device)
        self.transfer.register(kv_regions.regions(pool, self.aux))
        self.counters = {"pd_rooms_ok": 0, "pd_rooms_failed": 0, "pd_rooms_aborted": 0,
                         "pd_bytes": 0, "pd_transfer_seconds": 0.0, "pd_checksum_layers_ok": 0,
                         "pd_checksum_mismatches": 0}  # fmt: skip

    # ---- what the engine loop and engine_info read ------------------------------------------
    @property
    def context_length(self) -> int:
        return self.engine.context_length

    @property
    def model_config(self) -> Any:
        return self.engine.model_config

    @property
    def generation_defaults(self) -> dict:
        return self.engine.generation_defaults

    def flush_cache(self) -> bool:
        return self.engine.flush_cache()

    def idle(self) -> bool:
        return self.engine.idle()  # one rank: nothing to join

    def stats(self) -> dict:
        return {**self.engine.stats(), **self.counters, "pd_role": self.role,
                "pd_rooms_active": self.active_rooms(),
                "pd_transfer_backend": self.transfer.name}  # fmt: skip

    def active_rooms(self) -> int:
        raise NotImplementedError

    # ---- sockets -------------------------------------------------------------------------
    def send(self, endpoint: str, frames: list[bytes]) -> None:
        """Best effort, never blocking: a dead peer's messages are dropped."""
        sock = self.outboxes.get(endpoint)
        if sock is None:
            sock = self.context.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 10000)
            sock.connect(endpoint)
            self.outboxes[endpoint] = sock
        try:
            sock.send_multipart(frames, zmq.NOBLOCK)
        except zmq.Again:
            pass

    def receive(self, timeout_ms: int) -> list[list[bytes]]:
        messages = []
        if not self.inbox.poll(timeout_ms):
            return messages
        while True:
            try:
                messages.append(self.inbox.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                return messages

    def close(self, graceful: bool = True) -> None:
        for sock in self.outboxes.values():
            sock.close(linger=0)
        self.inbox.close(linger=0)
        self.transfer.close()
        self.context.term()
        self.engine.close(graceful)


def aborted_output(req: Req) -> RequestOutput:
    req.finish("abort")
    return req.take_output()


def expired(since: float, timeout: float) -> bool:
    return time.monotonic() - since > timeout
