"""The decode role: for each request, find its prefill through the bootstrap server, preallocate
the prompt's KV pages and an aux slot, send their indices for the room, and start decoding once the
prefill reports Success (and, with NIXL, its write notification arrived): the first token and its
logprob come from the aux record, the rest is ordinary decoding (EAGLE included). With `--tp N`
this is the group's first rank: the KV lands in its pool and `Engine.adopt` copies it to the
group's other ranks (a KV_SHARE round) before the request decodes. Under DP attention each
attention group's first rank runs its own decode role for the requests dispatched to it.

A room fails, with its pages and aux slot freed at once, when the prefill reports Failed, the
heartbeat loses the prefill, the checksums differ, or `--disaggregation-timeout` passes.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from dsaserve.args import ServerArgs
from dsaserve.cluster.addresses import split_host_port
from dsaserve.disaggregation import aux_record, kv_regions
from dsaserve.disaggregation.directory import PrefillDirectory
from dsaserve.disaggregation.protocol import (
    MAX_ROOM,
    Abort,
    FrameError,
    KVPoll,
    Registration,
    Status,
    TransferInfo,
    integer,
)
from dsaserve.disaggregation.role_engine import Reject, RoleEngine, aborted_output, expired
from dsaserve.engine.messages import GenerateRequest, RequestOutput
from dsaserve.engine.request import Req

logger = logging.getLogger(__name__)


@dataclass
class Room:
    req: Req
    address: str  # the prefill's bootstrap host:port
    since: float
    state: KVPoll = KVPoll.Bootstrapping
    endpoint: str | None = None  # the prefill rank's ZMQ endpoint
    session: str | None = None  # the prefill's session the destination was sent to
    reply_to: str | None = None  # this decode's endpoint as given to that prefill
    pages: list[int] = field(default_factory=list)
    aux_index: int | None = None
    detail: dict | None = None  # the Success status, waiting for its notification


class DecodeEngine(RoleEngine):
    role = "decode"

    def __init__(self, engine: Any, args: ServerArgs, reject: Reject) -> None:
        slots = 2 * max(engine.scheduler.config.max_running_requests, 16)
        super().__init__(engine, args, reject, aux_slots=slots)
        self.slots = aux_record.SlotPool(slots)
        self.directory = PrefillDirectory(args.disaggregation_heartbeat_interval, self.secret)
        self.rooms: dict[int, Room] = {}
        self.room_of: dict[str, int] = {}
        self.registered: dict[str, str | None] = {}  # prefill endpoint -> session registered
        self.notified: set[int] = set()
        logger.info("decode: KV over %s, receiving at %s", self.transfer.name, self.endpoint)

    def active_rooms(self) -> int:
        return len(self.rooms)

    # ---- requests ------------------------------------------------------------------------
    def add_request(self, request: GenerateRequest) -> None:
        boot = request.bootstrap
        if boot is None:
            raise ValueError(
                "bootstrap_room: this server runs --disaggregation-mode decode; send requests "
                "through sglang-router --pd-disaggregation"
            )
        if boot.room in self.rooms:
            raise ValueError(f"bootstrap_room {boot.room} is already in flight")
        req = self.engine.make_req(request)
        address = f"{boot.host}:{boot.port}"
        self.rooms[boot.room] = Room(req, address, time.monotonic())
        self.room_of[req.rid] = boot.room
        self.directory.want(address)

    def abort(self, rid: str) -> RequestOutput | None:
        room = self.room_of.get(rid)
        if room is None:
            return self.engine.abort(rid)
        state = self._drop(room)
        self.counters["pd_rooms_aborted"] += 1
        if state.endpoint is not None:
            self.send(state.endpoint, Abort(room, state.reply_to).frames())
        return aborted_output(state.req)

    # ---- the step ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        busy = self.engine.has_work()
        self.receive(0 if busy else 5, lambda frames: self._status(Status.parse(frames)))
        if self.transfer.notifies:
            self._notifications()
        outputs: list[RequestOutput] = []
        for room, state in list(self.rooms.items()):
            outputs += self._advance(room, state)
        if self.engine.has_work():
            outputs += self.engine.step()
        else:  # rooms waiting on their KV
            self.engine.idle()  # --tp N: the other ranks' heartbeat
        return outputs

    def _advance(self, room: int, state: Room) -> list[RequestOutput]:
        timeout = self.args.disaggregation_timeout
        if state.state == KVPoll.Bootstrapping:
            self._bootstrap(room, state)
        elif state.state == KVPoll.Success and self._written(room):
            return self._finish(room, state)
        else:
            prefill = self.directory.get(state.address)
            if prefill.lost or (prefill.session and prefill.session != state.session):
                reason = prefill.lost or "the prefill restarted (a new session) during the transfer"
                return self._fail(room, reason, 503) or []
        if room in self.rooms and expired(state.since, timeout):
            self._fail(room, f"the KV of room {room} did not arrive within {timeout}s", 504)
        return []

    def _notifications(self) -> None:
        """The rooms whose KV write finished (NIXL's notification tags: their room ids)."""
        for tag in self.transfer.notifications():
            try:
                room = integer("notification", tag, 0, MAX_ROOM)
            except FrameError as e:
                self.frames.dropped(e.kind, str(e))
                continue
            if room in self.rooms:
                self.notified.add(room)

    def _written(self, room: int) -> bool:
        """Whether the write's notification came (NIXL sends one; others need none)."""
        return not self.transfer.notifies or room in self.notified

    def _bootstrap(self, room: int, state: Room) -> None:
        prefill = self.directory.get(state.address)
        if prefill.lost and prefill.answered_at > state.since:  # still lost after the room came
            return self._fail(room, prefill.lost, 503)
        endpoint = prefill.endpoint(room)  # the prefill's attention group for this room
        if endpoint is None:  # resolving (a restarted prefill answers within a look)
            return
        reply_to = self.endpoint_for(split_host_port(state.address)[0])
        if self.registered.get(endpoint, "") != prefill.session:
            registration = Registration(
                reply_to, self.agent_name, self.transfer.metadata(), self.layout
            )
            self.send(endpoint, registration.frames())
            self.registered[endpoint] = prefill.session
        if not self._allocate(state):
            return  # no free KV yet: try again next step
        state.endpoint, state.session = endpoint, prefill.session
        state.reply_to = reply_to
        info = TransferInfo(room, reply_to, self.agent_name, state.pages, state.aux_index)
        self.send(endpoint, info.frames())
        state.state = KVPoll.WaitingForInput

    def _allocate(self, state: Room) -> bool:
        pool, cache = self.engine.pool, self.engine.cache
        need = kv_regions.pages_for(len(state.req.prompt_ids), pool.page_size)
        if pool.pages.num_free < need:
            cache.evict(need - pool.pages.num_free)
        slot = self.slots.take()
        pages = pool.pages.alloc(need) if slot is not None else None
        if pages is None:
            if slot is not None:
                self.slots.give(slot)
            return False
        state.pages, state.aux_index = pages, slot
        return True

    def _status(self, status: Status) -> None:
        state = self.rooms.get(status.room)
        if state is None:
            return
        if state.state != KVPoll.WaitingForInput:  # it has no destination yet, or has its KV
            raise FrameError("status", f"{status.status.name} for room {status.room} in state "
                             f"{state.state.name}")  # fmt: skip
        if status.status == KVPoll.Failed:
            reason = str((status.detail or {}).get("reason", "the prefill reported Failed"))
            self._fail(status.room, f"prefill: {reason[:300]}", 500)
        elif status.status == KVPoll.Success:
            state.state, state.detail = KVPoll.Success, success_detail(status.detail or {})

    def _finish(self, room: int, state: Room) -> list[RequestOutput]:
        self.notified.discard(room)
        detail = state.detail or {}
        if "checksums" in detail:
            error = self._verify(state, detail["checksums"])
            if error:
                self._fail(room, error, 500)
                return []
        vocab = self.engine.model_config.vocab_size
        try:  # the prefill wrote this record into our memory: check it like a frame
            token, logprob = aux_record.unpack(self.aux, state.aux_index, vocab)
        except ValueError as e:
            self._fail(room, f"room {room}: the prefill's first token is unusable: {e}", 500)
            return []
        pages = state.pages
        self.rooms.pop(room)
        self.room_of.pop(state.req.rid, None)
        self.slots.give(state.aux_index)
        self.counters["pd_rooms_ok"] += 1
        self.counters["pd_bytes"] += detail["bytes"]
        self.counters["pd_transfer_seconds"] += detail["seconds"]
        return self.engine.adopt(state.req, pages, token, logprob)

    def _verify(self, state: Room, expected: dict) -> str | None:
        got = kv_regions.checksums(self.engine.pool, state.pages, len(state.req.prompt_ids))
        bad = [f"{cache}[{i}]" for cache in ("kv", "index")
               for i, (a, b) in enumerate(zip(got[cache], expected[cache])) if a != b]  # fmt: skip
        if len(got["kv"]) != len(expected["kv"]) or len(got["index"]) != len(expected["index"]):
            bad.append("layer count")
        if bad:
            self.counters["pd_checksum_mismatches"] += 1
            return f"KV checksum mismatch for room {state.req.rid}: {', '.join(bad)}"
        self.counters["pd_checksum_layers_ok"] += len(got["kv"]) + len(got["index"])
        return None

    def _fail(self, room: int, reason: str, status: int) -> None:
        state = self._drop(room)
        logger.warning("room %d failed: %s", room, reason)
        self.counters["pd_rooms_failed"] += 1
        if state.endpoint is not None:
            self.send(state.endpoint, Abort(room, state.reply_to).frames())
        self.reject([state.req.rid], reason, status)

    def _drop(self, room: int) -> Room:
        state = self.rooms.pop(room)
        self.room_of.pop(state.req.rid, None)
        if state.pages:
            self.engine.pool.pages.free(state.pages)
        if state.aux_index is not None:
            self.slots.give(state.aux_index)
        self.notified.discard(room)
        return state

    def close(self, graceful: bool = True) -> None:
        self.directory.close()
        super().close(graceful)


def success_detail(detail: dict) -> dict:
    """The fields of a Success status this role reads, checked (FrameError otherwise)."""
    size, seconds = detail.get("bytes", 0), detail.get("seconds", 0.0)
    sums = detail.get("checksums")
    if isinstance(size, bool) or not isinstance(size, int) or not isinstance(seconds, int | float):
        raise FrameError("status", "Success with malformed bytes / seconds")
    checked: dict = {"bytes": max(size, 0), "seconds": max(float(seconds), 0.0)}
    if sums is not None:
        lists = [sums.get(k) if isinstance(sums, dict) else None for k in ("kv", "index")]
        if not all(isinstance(x, list) and all(isinstance(d, str) for d in x) for x in lists):
            raise FrameError("status", "Success with malformed checksums")
        checked["checksums"] = {"kv": lists[0], "index": lists[1]}
    return checked
