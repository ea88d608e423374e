"""Messages between the API process and the engine process (msgspec msgpack over ZMQ).

The API process binds two sockets in a private temp folder: PUSH to the engine (requests, aborts,
control calls) and PULL from it (outputs, replies, readiness, fatal errors). When DP attention
spans nodes they are TCP ports instead, CURVE-authenticated with the cluster secret.
"""

from __future__ import annotations

import os
import socket
import tempfile
from typing import Any

import msgspec

from dsaserve.cluster.addresses import tcp_endpoint
from dsaserve.cluster.zmq_auth import ZmqAuth
from dsaserve.engine.messages import GenerateRequest, RequestOutput


class Submit(msgspec.Struct, tag=True):
    requests: list[GenerateRequest]


class Abort(msgspec.Struct, tag=True):
    rids: list[str]


class Control(msgspec.Struct, tag=True):
    """A call answered by a ControlReply with the same id: op in stats, flush_cache, info."""

    id: int
    op: str


class Shutdown(msgspec.Struct, tag=True):
    pass


class Outputs(msgspec.Struct, tag=True):
    outputs: list[RequestOutput]


class Rejected(msgspec.Struct, tag=True):
    """Requests refused at admission: 429 (queue full) or 400 (input the engine cannot serve)."""

    rids: list[str]
    message: str
    status: int = 429


class ControlReply(msgspec.Struct, tag=True):
    id: int
    result: Any


class Stats(msgspec.Struct, tag=True):
    """The engine's stats, sent whenever they change (before the outputs of the same step)."""

    stats: dict
    group: int = 0  # DP attention: the attention group that sent them


class Ready(msgspec.Struct, tag=True):
    info: dict
    group: int = 0  # the attention group (DP attention) or the replica (--dp N) now ready


class Fatal(msgspec.Struct, tag=True):
    message: str


ToEngine = Submit | Abort | Control | Shutdown
FromEngine = Outputs | Rejected | ControlReply | Stats | Ready | Fatal

_encoder = msgspec.msgpack.Encoder()
_to_engine = msgspec.msgpack.Decoder(ToEngine)
_from_engine = msgspec.msgpack.Decoder(FromEngine)


def encode(message: ToEngine | FromEngine) -> bytes:
    return _encoder.encode(message)


def decode_to_engine(data: bytes) -> ToEngine:
    return _to_engine.decode(data)


def decode_from_engine(data: bytes) -> FromEngine:
    return _from_engine.decode(data)


class IpcPaths(msgspec.Struct):
    """The socket addresses: requests go to `to_engine` (group g's to `for_group(g)`), results
    come back on `from_engine`. On one node they are `ipc://` files in a private folder; when
    DP attention spans nodes (`tcp`), TCP ports on node 0's `--dist-init-addr` interface,
    CURVE-authenticated by the cluster secret (`auth_sockets`), and the private folder holds
    only the heartbeat file."""

    to_engine: str
    from_engine: str
    group_inboxes: list[str] = msgspec.field(default_factory=list)  # tcp: every group's
    home: str = ""  # the private folder (the heartbeat file; on one node the sockets too)
    first_slot: int = 0  # this engine's rank 0's heartbeat slot (--dp replica r: r * tp)

    @classmethod
    def fresh(cls) -> IpcPaths:
        folder = tempfile.mkdtemp(prefix="dsaserve-ipc-")
        return cls(f"ipc://{folder}/to_engine", f"ipc://{folder}/from_engine", home=folder)

    @classmethod
    def tcp(cls, host: str, groups: int) -> IpcPaths:
        """TCP addresses on `host` (node 0's address, which the other nodes reach): one request
        port per group and the output port, picked by the OS."""
        ip = socket.gethostbyname(host)
        probes = [socket.socket() for _ in range(groups + 1)]
        try:
            for probe in probes:
                probe.bind((ip, 0))
            ports = [probe.getsockname()[1] for probe in probes]
        finally:
            for probe in probes:
                probe.close()
        inboxes = [tcp_endpoint(ip, port) for port in ports[:groups]]
        folder = tempfile.mkdtemp(prefix="dsaserve-ipc-")
        return cls(inboxes[0], tcp_endpoint(ip, ports[-1]), inboxes, folder)

    @property
    def folder(self) -> str:
        return self.home or os.path.dirname(self.to_engine.removeprefix("ipc://"))

    @property
    def heartbeat(self) -> str:
        """The ranks' heartbeat file (runtime/heartbeat.py), in the private folder."""
        return os.path.join(self.folder, "heartbeat")

    @property
    def over_tcp(self) -> bool:
        return self.to_engine.startswith("tcp://")

    def for_group(self, group: int) -> IpcPaths:
        """Group g's leader (DP attention) or replica g's engine (--dp N) has its own request
        socket; outputs share one."""
        if self.group_inboxes:
            return IpcPaths(self.group_inboxes[group], self.from_engine, self.group_inboxes,
                            self.home)  # fmt: skip
        return IpcPaths(self.to_engine + (f"_{group}" if group else ""), self.from_engine,
                        home=self.home)  # fmt: skip

    def cleanup(self, groups: int = 1) -> None:
        extra = [self.for_group(g).to_engine for g in range(1, groups)]
        sockets = [a.removeprefix("ipc://") for a in (self.to_engine, self.from_engine, *extra)
                   if a.startswith("ipc://")]  # fmt: skip
        for path in (*sockets, self.heartbeat):
            if os.path.exists(path):
                os.unlink(path)
        if os.path.isdir(self.folder) and not os.listdir(self.folder):
            os.rmdir(self.folder)


def auth_sockets(context: Any, paths: IpcPaths, secret: str | None) -> ZmqAuth | None:
    """The CURVE keys for `context`'s sockets when `paths` are TCP ports (DP attention across
    nodes; cluster/zmq_auth.py), else None: `ipc://` files in a private folder need none."""
    return ZmqAuth(context, secret) if paths.over_tcp else None


def serve_socket(auth: ZmqAuth | None, sock: Any) -> Any:
    """Before `bind`: authenticated when `auth` is (the API process's side)."""
    return auth.serve(sock) if auth is not None else sock


def dial_socket(auth: ZmqAuth | None, sock: Any) -> Any:
    """Before `connect`: authenticated when `auth` is (an engine's side)."""
    return auth.dial(sock) if auth is not None else sock
