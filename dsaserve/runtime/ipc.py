"""Messages between the API process and the engine process (msgspec msgpack over ZMQ).

The API process binds two sockets in a private temp folder: PUSH to the engine (requests, aborts,
control calls) and PULL from it (outputs, replies, readiness, fatal errors).
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import msgspec

from dsaserve.engine.io import GenerateRequest, RequestOutput


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
    """The two socket addresses: requests go to `to_engine`, results come back on `from_engine`."""

    to_engine: str
    from_engine: str

    @classmethod
    def fresh(cls) -> IpcPaths:
        folder = tempfile.mkdtemp(prefix="dsaserve-ipc-")
        return cls(f"ipc://{folder}/to_engine", f"ipc://{folder}/from_engine")

    def for_group(self, group: int) -> IpcPaths:
        """Group g's leader (DP attention) or replica g's engine (--dp N) has its own request
        socket; outputs share one."""
        return IpcPaths(self.to_engine + (f"_{group}" if group else ""), self.from_engine)

    def cleanup(self, groups: int = 1) -> None:
        extra = [self.for_group(g).to_engine for g in range(1, groups)]
        for address in (self.to_engine, self.from_engine, *extra):
            path = address.removeprefix("ipc://")
            if os.path.exists(path):
                os.unlink(path)
        folder = os.path.dirname(self.to_engine.removeprefix("ipc://"))
        if os.path.isdir(folder) and not os.listdir(folder):
            os.rmdir(folder)
