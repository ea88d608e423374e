"""Room states and the ZMQ messages between a decode and a prefill (multipart, ASCII fields as
SGLang sends them).

Decode -> prefill (the prefill rank's PULL socket):
- register, once per (decode, prefill session): `[b"REGISTER", endpoint, agent_name,
  agent_metadata, layout JSON]` (layout: buffer base pointers and item sizes).
- per room: `[room, endpoint, agent_name, page indices (int32), aux index]`.
- abort: `[b"ABORT", room, endpoint]`.

Prefill -> decode (the decode's PULL socket): `[room, status, rank, detail JSON]`; the detail of a
`Success` carries the per-layer checksums (when enabled), of a `Failed` the reason.

Every parse checks what it reads (frame count, sizes, ASCII integers in range, endpoints, JSON
objects) and raises `FrameError` naming the frame kind; the roles drop such a frame
(cluster/frame_log.py). What a frame means for a room (its pages within the decode's pool, its
aux slot) is checked where the room is known.
"""

from __future__ import annotations

import enum
import json
import re
from dataclasses import dataclass

import numpy as np


class KVPoll(enum.IntEnum):
    """SGLang's room states (`KVPoll`), in order."""

    Failed = 0
    Bootstrapping = 1
    WaitingForInput = 2
    Transferring = 3
    Success = 4


REGISTER = b"REGISTER"
ABORT = b"ABORT"
MAX_ROOM = 2**63 - 1
MAX_INDEX = 2**31 - 1
MAX_PAGES = 1 << 22  # 4M pages (of >= 1 token): far over any context
MAX_TEXT = 512
MAX_JSON_BYTES = 1 << 20
_INT = re.compile(rb"-?[0-9]{1,19}")
_ENDPOINT = re.compile(r"tcp://(\[[0-9A-Fa-f:.%a-z]+\]|[A-Za-z0-9.\-_]+):[0-9]{1,5}")


class FrameError(ValueError):
    """A frame that does not parse; `kind` names the message it claimed to be."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


@dataclass
class Registration:
    endpoint: str  # the decode's PULL socket, tcp://host:port
    agent_name: str
    agent_metadata: bytes
    layout: dict

    def frames(self) -> list[bytes]:
        return [REGISTER, self.endpoint.encode(), self.agent_name.encode(), self.agent_metadata,
                json.dumps(self.layout).encode()]  # fmt: skip

    @classmethod
    def parse(cls, frames: list[bytes]) -> Registration:
        _count("register", frames, 5)
        return cls(endpoint("register", frames[1]), text("register", frames[2]), frames[3],
                   json_object("register", frames[4]))  # fmt: skip


@dataclass
class TransferInfo:
    """The decode's destination for one room: its page indices and aux slot."""

    room: int
    endpoint: str
    agent_name: str
    pages: list[int]
    aux_index: int

    def frames(self) -> list[bytes]:
        pages = np.asarray(self.pages, dtype=np.int32).tobytes()
        return [str(self.room).encode(), self.endpoint.encode(), self.agent_name.encode(), pages,
                str(self.aux_index).encode()]  # fmt: skip

    @classmethod
    def parse(cls, frames: list[bytes]) -> TransferInfo:
        kind = "transfer-info"
        _count(kind, frames, 5)
        raw = frames[3]
        if len(raw) % 4 or len(raw) > 4 * MAX_PAGES:
            raise FrameError(kind, f"page indices of {len(raw)} bytes (int32 each)")
        pages = np.frombuffer(raw, dtype=np.int32)
        if pages.size and int(pages.min()) < 0:
            raise FrameError(kind, "a negative page index")
        return cls(integer(kind, frames[0], 0, MAX_ROOM), endpoint(kind, frames[1]),
                   text(kind, frames[2]), pages.tolist(),
                   integer(kind, frames[4], 0, MAX_INDEX))  # fmt: skip


@dataclass
class Abort:
    room: int
    endpoint: str

    def frames(self) -> list[bytes]:
        return [ABORT, str(self.room).encode(), self.endpoint.encode()]

    @classmethod
    def parse(cls, frames: list[bytes]) -> Abort:
        _count("abort", frames, 3)
        return cls(integer("abort", frames[1], 0, MAX_ROOM), endpoint("abort", frames[2]))


@dataclass
class Status:
    room: int
    status: KVPoll
    rank: int = 0
    detail: dict | None = None

    def frames(self) -> list[bytes]:
        return [str(self.room).encode(), str(int(self.status)).encode(), str(self.rank).encode(),
                json.dumps(self.detail or {}).encode()]  # fmt: skip

    @classmethod
    def parse(cls, frames: list[bytes]) -> Status:
        if len(frames) not in (3, 4):
            raise FrameError("status", f"{len(frames)} parts, expected 4")
        detail = json_object("status", frames[3]) if len(frames) > 3 else {}
        status = KVPoll(integer("status", frames[1], 0, len(KVPoll) - 1))
        return cls(integer("status", frames[0], 0, MAX_ROOM), status,
                   integer("status", frames[2], 0, MAX_INDEX), detail)  # fmt: skip


def parse_to_prefill(frames: list[bytes]) -> Registration | TransferInfo | Abort:
    if not frames:
        raise FrameError("empty", "a message without parts")
    if frames[0] == REGISTER:
        return Registration.parse(frames)
    if frames[0] == ABORT:
        return Abort.parse(frames)
    return TransferInfo.parse(frames)


def _count(kind: str, frames: list[bytes], expected: int) -> None:
    if len(frames) != expected:
        raise FrameError(kind, f"{len(frames)} parts, expected {expected}")


def integer(kind: str, frame: bytes, low: int, high: int) -> int:
    if not _INT.fullmatch(frame) or not low <= int(frame) <= high:
        raise FrameError(kind, f"{frame[:24]!r} is not an integer in [{low}, {high}]")
    return int(frame)


def text(kind: str, frame: bytes) -> str:
    try:
        value = frame.decode("ascii")
    except UnicodeDecodeError:
        raise FrameError(kind, "a name that is not ASCII") from None
    if not 0 < len(value) <= MAX_TEXT or not value.isprintable():
        raise FrameError(kind, f"a name of {len(value)} characters")
    return value


def endpoint(kind: str, frame: bytes) -> str:
    value = text(kind, frame)
    if not _ENDPOINT.fullmatch(value) or not 0 < int(value.rsplit(":", 1)[1]) < 65536:
        raise FrameError(kind, f"{value[:80]!r} is not a tcp://host:port endpoint")
    return value


def json_object(kind: str, frame: bytes) -> dict:
    if len(frame) > MAX_JSON_BYTES:
        raise FrameError(kind, f"a JSON part of {len(frame)} bytes")
    try:
        value = json.loads(frame)
    except (ValueError, RecursionError, UnicodeDecodeError):
        raise FrameError(kind, "a JSON part that does not parse") from None
    if not isinstance(value, dict):
        raise FrameError(kind, "a JSON part that is not an object")
    return value
