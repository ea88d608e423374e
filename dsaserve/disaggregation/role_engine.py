"""What both roles share: the wrapper around an `Engine`, ZMQ sockets, counters, failures.

The inbox binds the internal host (cluster/addresses.py: `--host` when a cluster secret is set,
loopback otherwise) and is a CURVE server when there is a secret (cluster/zmq_auth.py); peers are
given the advertised address, never a wildcard. Every frame that arrives is parsed and acted on
under one guard: a frame that fails is counted (`pd_frames_dropped`), logged sparingly and
dropped, or fails only its room, and the engine step goes on.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections.abc import Callable
from typing import Any

import zmq

from dsaserve.args import ServerArgs
from dsaserve.cluster.addresses import advertise_host, internal_host, is_loopback, tcp_endpoint
from dsaserve.cluster.frame_log import FrameLog
from dsaserve.cluster.secret import cluster_secret
from dsaserve.cluster.zmq_auth import ZmqAuth
from dsaserve.disaggregation import aux_record, kv_regions
from dsaserve.disaggregation.protocol import FrameError
from dsaserve.disaggregation.transfer import create
from dsaserve.engine.messages import RequestOutput
from dsaserve.engine.request import Req

logger = logging.getLogger(__name__)
# reject(rids, message, http status): refuse requests whose KV cannot arrive (API error shape)
Reject = Callable[[list[str], str, int], None]
MAX_MESSAGES_PER_STEP = 4096  # the rest wait for the next step (a flood cannot stall one)


class RoleEngine:
    """An `Engine` with one disaggregation role in front; the engine loop drives it unchanged."""

    role = ""

    def __init__(self, engine: Any, args: ServerArgs, reject: Reject, aux_slots: int) -> None:
        self.engine = engine
        self.args = args
        self.reject = reject
        self.secret = cluster_secret(args)
        self.bind_host = internal_host(args)
        self.context = zmq.Context()
        self.auth = ZmqAuth(self.context, self.secret)
        self.inbox = self.auth.serve(self.context.socket(zmq.PULL))
        self.inbox.ipv6 = ":" in self.bind_host
        self.rank_port = self.inbox.bind_to_random_port(tcp_endpoint(self.bind_host, None))
        self.advertised: dict[str | None, str] = {}
        self.endpoint = self.endpoint_for(None)
        self.outboxes: dict[str, zmq.Socket] = {}
        self.session = uuid.uuid4().hex[:12]
        self.frames = FrameLog(logger, f"the {self.role}'s peers")
        self.aux = aux_record.buffer(aux_slots)
        pool = engine.pool
        self.layout = kv_regions.describe(pool, engine.with_mtp, self.aux)
        self.agent_name = f"dsaserve-{self.role}-{self.session}"
        if is_loopback(self.bind_host):  # UCX's TCP transport then listens on loopback too
            os.environ.setdefault("UCX_NET_DEVICES", "lo")
        backend = args.disaggregation_transfer_backend
        self.transfer = create(backend, self.agent_name, advertise_host(args),
                               args.disaggregation_ib_device)  # fmt: skip
        self.transfer.register(kv_regions.regions(pool, self.aux))
        self.counters = {"pd_rooms_ok": 0, "pd_rooms_failed": 0, "pd_rooms_aborted": 0,
                         "pd_bytes": 0, "pd_transfer_seconds": 0.0, "pd_checksum_layers_ok": 0,
                         "pd_checksum_mismatches": 0}  # fmt: skip

    def endpoint_for(self, peer_host: str | None) -> str:
        """This role's inbox as advertised to a peer on `peer_host` (None: to anyone)."""
        if peer_host not in self.advertised:
            host = advertise_host(self.args, peer_host)
            self.advertised[peer_host] = tcp_endpoint(host, self.rank_port)
        return self.advertised[peer_host]

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
                "pd_rooms_active": self.active_rooms(), "pd_frames_dropped": self.frames.total,
                "pd_transfer_backend": self.transfer.name, "pd_endpoint": self.endpoint,
                "pd_peers": sorted(self.peer_endpoints())}  # fmt: skip

    def peer_endpoints(self) -> list[str]:
        """The ZMQ endpoints of the peers this role talks to (reported in the stats)."""
        return list(self.outboxes)

    def active_rooms(self) -> int:
        raise NotImplementedError

    def has_work(self) -> bool:
        """Rooms in flight, or frames waiting (so an idle role still reads its peers)."""
        return self.engine.has_work() or self.active_rooms() > 0 or bool(self.inbox.poll(0))

    # ---- sockets -------------------------------------------------------------------------
    def send(self, endpoint: str, frames: list[bytes]) -> None:
        """Best effort, never blocking: a dead peer's messages are dropped."""
        sock = self.outboxes.get(endpoint)
        if sock is None:
            sock = self.auth.dial(self.context.socket(zmq.PUSH))
            sock.ipv6 = endpoint.startswith("tcp://[")
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 10000)
            sock.connect(endpoint)
            self.outboxes[endpoint] = sock
        try:
            sock.send_multipart(frames, zmq.NOBLOCK)
        except zmq.Again:
            pass

    def receive(self, timeout_ms: int, handle: Callable[[list[bytes]], None]) -> None:
        """Hand each waiting message to `handle`; one that fails is dropped, never raised."""
        if not self.inbox.poll(timeout_ms):
            return
        for _ in range(MAX_MESSAGES_PER_STEP):
            try:
                frames = self.inbox.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                handle(frames)
            except FrameError as e:
                self.frames.dropped(e.kind, str(e))
            except Exception as e:  # a frame this role cannot act on must not end the engine
                self.frames.dropped("unusable", f"{type(e).__name__}: {e}", exc_info=True)

    def close(self, graceful: bool = True) -> None:
        for sock in self.outboxes.values():
            sock.close(linger=0)
        self.inbox.close(linger=0)
        self.transfer.close()
        self.auth.close()
        self.context.term()
        self.engine.close(graceful)


def aborted_output(req: Req) -> RequestOutput:
    req.finish("abort")
    return req.take_output()


def expired(since: float, timeout: float) -> bool:
    return time.monotonic() - since > timeout
