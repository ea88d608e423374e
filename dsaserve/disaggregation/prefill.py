"""The prefill role: hold each request until its decode sends KV destinations, run the prompt
(and sample the first token), write every layer's KV, indexer keys, MTP entries and the aux
record into the decode's memory, then report the room's status.

With `--tp N` the prefill is one attention group: every rank holds the same KV bytes (the MLA
entry and indexer keys are replicated), so the group's first rank, which runs this role, writes
every page from its own pool and registers alone with the bootstrap server (`attn_tp_size` 1);
the other ranks only compute. (A `--tp N` decode's first rank receives it all and copies it to
its group: `Engine.adopt`.) Under DP attention (`--dp D --enable-dp-attention`) each of the D
groups' first rank runs this role on its own pool: group 0's hosts the bootstrap server, every
group registers there as `attn_dp_rank` g of `attn_dp_size` D, the API process sends room r to
group r % D, and the decode sends that room's destination to the same group
(directory.py), which writes the room's pages from its pool to the decode's.

Departures from SGLang, on purpose: the write runs in the engine loop right after the forward
(one synchronous transfer per room, before the pages go back to the radix cache), not in a pool
of sender threads; the per-room checksum (`--disaggregation-checksum`) is ours.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from dsaserve.args import ServerArgs
from dsaserve.cluster.addresses import advertise_host, is_wildcard, split_host_port
from dsaserve.disaggregation import aux_record, bootstrap, kv_regions
from dsaserve.disaggregation.protocol import (
    Abort,
    FrameError,
    KVPoll,
    Registration,
    Status,
    TransferInfo,
    parse_to_prefill,
)
from dsaserve.disaggregation.role_engine import Reject, RoleEngine, aborted_output, expired
from dsaserve.disaggregation.transfer import base as transfer_base
from dsaserve.engine.messages import GenerateRequest, RequestOutput
from dsaserve.engine.request import Req

logger = logging.getLogger(__name__)
FAILED_MEMORY_S = 600.0
MAX_PEERS = 1024  # decodes registered at once
MAX_EARLY_INFOS = 65536  # destinations waiting for their request to arrive
REGISTER_WAIT_S = 120.0  # a group g > 0 waits this long for group 0's bootstrap server


@dataclass
class Peer:
    handle: str | None
    layout: dict
    error: str | None


@dataclass
class Room:
    req: Req
    since: float
    state: KVPoll = KVPoll.Bootstrapping


class PrefillEngine(RoleEngine):
    role = "prefill"

    def __init__(self, engine: Any, args: ServerArgs, reject: Reject, group: int = 0,
                 groups: int = 1) -> None:  # fmt: skip
        super().__init__(engine, args, reject, aux_slots=1)
        engine.before_release = self._on_release
        self.group, self.groups = group, groups
        self.peers: dict[str, Peer] = {}
        self.rooms: dict[int, Room] = {}
        self.room_of: dict[str, int] = {}
        self.infos: dict[int, tuple[TransferInfo, float]] = {}
        self.failed: dict[int, tuple[str, float]] = {}  # rooms that failed here, for late infos
        self.transfer_failed: dict[str, str] = {}
        port = args.disaggregation_bootstrap_port
        self.server = None  # group 0's
        if group == 0:
            self.server = bootstrap.BootstrapServer(self.bind_host, port, self.secret,
                                                    args.header_timeout)  # fmt: skip
            port = self.server.port
        wait = 0.0 if group == 0 else REGISTER_WAIT_S  # group 0's server may still be starting
        self.bootstrap_port = port  # the bound one (reported; --disaggregation-bootstrap-port 0)
        address = f"{self._bootstrap_host()}:{port}"
        self.registration_id = bootstrap.register_rank(address, self._rank_info(), self.secret,
                                                       wait=wait)  # fmt: skip
        logger.info("prefill group %d/%d: bootstrap server on port %d, KV over %s, rank at %s "
                    "(%s)", group, groups, port, self.transfer.name, self.endpoint,
                    "authenticated" if self.secret else "loopback, no cluster secret")  # fmt: skip

    def _bootstrap_host(self) -> str:
        """Where group 0's bootstrap server listens, as seen from this group's node."""
        if self.group and self.args.nnodes > 1:  # group 0 runs on node 0
            return split_host_port(self.args.dist_init_addr)[0]
        return "127.0.0.1" if is_wildcard(self.bind_host) else self.bind_host

    def _rank_info(self) -> dict:
        ranks = {"attn_tp_size": 1, "attn_tp_rank": 0, "attn_cp_size": 1, "attn_cp_rank": 0,
                 "attn_dp_size": self.groups, "attn_dp_rank": self.group, "pp_size": 1,
                 "pp_rank": 0, "system_dp_size": 1, "system_dp_rank": 0}  # fmt: skip
        return {**ranks, "rank_ip": advertise_host(self.args), "rank_port": self.rank_port,
                "page_size": self.engine.pool.page_size, "kv_cache_dtype": self.layout["dtype"],
                "dsaserve_session": self.session,
                "dsaserve_transfer_backend": self.transfer.name}  # fmt: skip

    def active_rooms(self) -> int:
        return len(self.rooms)

    def stats(self) -> dict:
        """With the bootstrap server's port where this group hosts it (group 0 only: under DP
        attention the groups' stats are summed)."""
        hosted = {"pd_bootstrap_port": self.bootstrap_port} if self.server else {}
        return {**super().stats(), **hosted}

    # ---- requests ------------------------------------------------------------------------
    def add_request(self, request: GenerateRequest) -> None:
        if request.bootstrap is None:
            raise ValueError(
                "bootstrap_room: this server runs --disaggregation-mode prefill; send requests "
                "through sglang-router --pd-disaggregation"
            )
        room = request.bootstrap.room
        if room in self.rooms:
            raise ValueError(f"bootstrap_room {room} is already in flight")
        sampling = {**request.sampling, "max_tokens": 1}  # the decode samples the rest
        req = self.engine.make_req(GenerateRequest(
            rid=request.rid, input_ids=request.input_ids, sampling=sampling,
            stream=request.stream, bootstrap=request.bootstrap,
        ))  # fmt: skip
        self.rooms[room] = Room(req, time.monotonic())
        self.room_of[req.rid] = room
        if room in self.infos:
            self._start(room)

    def _start(self, room: int) -> None:
        state = self.rooms[room]
        info = self.infos[room][0]
        peer = self.peers.get(info.endpoint)
        if peer is None or peer.error:
            reason = peer.error if peer else f"decode {info.endpoint} never registered"
            return self._fail(room, reason, 500)
        wrong = kv_regions.destination_error(peer.layout, info.pages, info.aux_index)
        if wrong:
            return self._fail(room, f"room {room}: the decode's destination is unusable: {wrong}",
                              500)  # fmt: skip
        state.state = KVPoll.WaitingForInput
        self.engine.enqueue(state.req)

    def abort(self, rid: str) -> RequestOutput | None:
        room = self.room_of.get(rid)
        if room is None:
            return self.engine.abort(rid)
        state = self._forget(room, "aborted at the prefill", "pd_rooms_aborted")
        if state.state == KVPoll.Bootstrapping:
            return aborted_output(state.req)
        return self.engine.abort(rid)

    # ---- the step ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        busy = self.engine.has_work()
        self.receive(0 if busy else 5, lambda frames: self._handle(parse_to_prefill(frames)))
        self._expire()
        if not self.engine.has_work():  # rooms waiting on their decode
            self.engine.idle()  # --tp N: the other ranks' heartbeat
            return []
        outputs = []
        for output in self.engine.step():
            if output.finished and output.rid in self.room_of:
                self.rooms.pop(self.room_of.pop(output.rid), None)
            reason = self.transfer_failed.pop(output.rid, None)
            if reason is not None:
                self.reject([output.rid], reason, 500)
            else:
                outputs.append(output)
        return outputs

    def _handle(self, message: Registration | TransferInfo | Abort) -> None:
        if isinstance(message, Registration):
            self._register(message)
        elif isinstance(message, TransferInfo):
            self._transfer_info(message)
        else:
            known = self.infos.get(message.room)
            if known is not None and known[0].endpoint != message.endpoint:
                raise FrameError("abort", f"room {message.room} belongs to another decode")
            room = self.rooms.get(message.room)
            if room is not None:
                self.counters["pd_rooms_aborted"] += 1
                self.reject([room.req.rid], f"room {message.room} aborted by the decode", 503)
                self._drop(message.room, room)
            self.infos.pop(message.room, None)

    def _register(self, message: Registration) -> None:
        if message.endpoint not in self.peers and len(self.peers) >= MAX_PEERS:
            raise FrameError("register", f"{MAX_PEERS} decodes are registered already")
        old = self.peers.pop(message.endpoint, None)
        if old is not None and old.handle:
            self.transfer.remove_peer(old.handle)
        error = kv_regions.mismatch(self.layout, message.layout)
        handle = None
        if error is None:
            try:
                handle = self.transfer.add_peer(message.agent_metadata)
            except Exception as e:
                error = f"the {self.transfer.name} transfer engine cannot reach the decode: {e}"
        if error:
            logger.error("decode %s cannot receive KV from here: %s", message.endpoint, error)
        self.peers[message.endpoint] = Peer(handle, message.layout, error)

    def _transfer_info(self, info: TransferInfo) -> None:
        if info.room in self.failed:
            status = Status(info.room, KVPoll.Failed, detail={"reason": self.failed[info.room][0]})
            self.send(info.endpoint, status.frames())
            return
        if info.room in self.infos:
            raise FrameError("transfer-info", f"room {info.room} has a destination already")
        if info.room not in self.rooms and len(self.infos) >= MAX_EARLY_INFOS:
            raise FrameError("transfer-info", f"{MAX_EARLY_INFOS} destinations wait already")
        self.infos[info.room] = (info, time.monotonic())
        room = self.rooms.get(info.room)
        if room is not None and room.state == KVPoll.Bootstrapping:
            self._start(info.room)

    def _expire(self) -> None:
        timeout = self.args.disaggregation_timeout
        for room, state in list(self.rooms.items()):
            if state.state == KVPoll.Bootstrapping and expired(state.since, timeout):
                reason = f"the decode sent no KV destination for room {room} within {timeout}s"
                self._fail(room, reason, 504)
        for room, (_, since) in list(self.infos.items()):
            if room not in self.rooms and expired(since, timeout):
                del self.infos[room]
        for room, (_, since) in list(self.failed.items()):
            if expired(since, FAILED_MEMORY_S):
                del self.failed[room]

    def _fail(self, room: int, reason: str, status: int) -> None:
        state = self.rooms.get(room)
        if state is None:
            return
        self.reject([state.req.rid], reason, status)
        self._drop(room, state)
        self._forget(room, reason)

    def _drop(self, room: int, state: Room) -> None:
        if state.state != KVPoll.Bootstrapping:
            self.engine.abort(state.req.rid)
        self.rooms.pop(room, None)
        self.room_of.pop(state.req.rid, None)

    def _forget(self, room: int, reason: str, counter: str = "pd_rooms_failed") -> Room | None:
        """Drop a room; tell its decode (when known) it failed."""
        self.counters[counter] += 1
        self.failed[room] = (reason, time.monotonic())
        entry = self.infos.pop(room, None)
        if entry is not None:
            detail = {"reason": reason}
            self.send(entry[0].endpoint, Status(room, KVPoll.Failed, detail=detail).frames())
        state = self.rooms.pop(room, None)
        if state is not None:
            self.room_of.pop(state.req.rid, None)
        return state

    # ---- the transfer (runs inside engine.step, before the pages are released) ------------
    def _on_release(self, req: Req) -> None:
        room = self.room_of.get(req.rid)
        if room is None or (req.finish_reason or {}).get("type") == "abort":
            return
        entry = self.infos.pop(room, None)
        if entry is None:  # forgotten meanwhile (the decode aborted it): nothing to send
            return
        info, peer = entry[0], self.peers.get(entry[0].endpoint)
        if self.rooms.get(room):
            self.rooms[room].state = KVPoll.Transferring
        try:
            if peer is None or peer.error:
                raise ValueError(peer.error if peer else "the decode's registration is gone")
            detail = self._write(room, req, info, peer)
        except Exception as e:  # TransferError, a bad destination, a backend's own error
            reason = f"KV transfer of room {room} to {info.endpoint} failed: {e}"
            logger.error("%s", reason)
            self.transfer_failed[req.rid] = reason
            self.infos[room] = (info, time.monotonic())  # so _forget tells the decode
            self._forget(room, reason)
            return
        self.counters["pd_rooms_ok"] += 1
        self.send(info.endpoint, Status(room, KVPoll.Success, detail=detail).frames())

    def peer_endpoints(self) -> list[str]:
        return list(self.peers)

    def _write(self, room: int, req: Req, info: TransferInfo, peer: Peer) -> dict:
        prompt_len = len(req.prompt_ids)
        pages = req.pages[: kv_regions.pages_for(prompt_len, self.engine.pool.page_size)]
        if len(info.pages) != len(pages):
            raise ValueError(f"the decode gave {len(info.pages)} pages for {len(pages)}")
        wrong = kv_regions.destination_error(peer.layout, info.pages, info.aux_index)
        if wrong:  # checked at the start too; the decode may have registered again since
            raise ValueError(wrong)
        token = req.output_ids[0]
        logprob = req.pending_logprobs[0] if req.pending_logprobs else None
        aux_record.pack(self.aux, 0, token, logprob)
        segments = kv_regions.kv_segments(self.layout, peer.layout, pages, info.pages)
        tail = [kv_regions.aux_segment(self.layout, peer.layout, 0, info.aux_index)]
        size = sum(s[2] for s in segments + tail)
        started = time.monotonic()
        kinds = (self.layout["kv_kind"], peer.layout["kv_kind"])
        # one write carrying the room's tag (the decode counts the room written when it arrives);
        # KV first in a write of its own where the memory kinds differ (one kind per write), or
        # where a fault hook is installed (transfer/base.py: its point between KV and aux)
        if kinds != transfer_base.HOST or transfer_base.WRITE_HOOK is not None:
            self.transfer.write(peer.handle, segments, b"", kinds)
            segments = []
        self.transfer.write(peer.handle, segments + tail, str(room).encode())
        seconds = time.monotonic() - started
        self.counters["pd_bytes"] += size
        self.counters["pd_transfer_seconds"] += seconds
        detail: dict = {"bytes": size, "seconds": seconds, "prompt_len": prompt_len}
        if self.args.disaggregation_checksum:
            detail["checksums"] = kv_regions.checksums(self.engine.pool, pages, prompt_len)
        return detail

    def close(self, graceful: bool = True) -> None:
        if self.server is not None:
            self.server.close()
        super().close(graceful)
