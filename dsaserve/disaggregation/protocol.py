"""Room states and the ZMQ messages between a decode and a prefill (multipart, ASCII fields as
SGLang sends them).

Decode -> prefill (the prefill rank's PULL socket):
- register, once per (decode, prefill session): `[b"REGISTER", endpoint, agent_name,
  agent_metadata, layout JSON]` (layout: buffer base pointers and item sizes).
- per room: `[room, endpoint, agent_name, page indices (int32), aux index]`.
- abort: `[b"ABORT", room, endpoint]`.

Prefill -> decode (the decode's PULL socket): `[room, status, rank, detail JSON]`; the detail of a
`Success` carries the per-layer checksums (when enabled), of a `Failed` the reason.
"""

from __future__ import annotations

import enum
import json
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
        return cls(frames[1].decode(), frames[2].decode(), frames[3], json.loads(frames[4]))


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
        pages = np.frombuffer(frames[3], dtype=np.int32).tolist()
        return cls(int(frames[0]), frames[1].decode(), frames[2].decode(), pages, int(frames[4]))


@dataclass
class Abort:
    room: int
    endpoint: str

    def frames(self) -> list[bytes]:
        return [ABORT, str(self.room).encode(), self.endpoint.encode()]

    @classmethod
    def parse(cls, frames: list[bytes]) -> Abort:
        return cls(int(frames[1]), frames[2].decode())


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
        detail = json.loads(frames[3]) if len(frames) > 3 else {}
        return cls(int(frames[0]), KVPoll(int(frames[1])), int(frames[2]), detail)


def parse_to_prefill(frames: list[bytes]) -> Registration | TransferInfo | Abort:
    if frames[0] == REGISTER:
        return Registration.parse(frames)
    if frames[0] == ABORT:
        return Abort.parse(frames)
    return TransferInfo.parse(frames)
