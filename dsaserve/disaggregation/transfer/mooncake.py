"""Mooncake transfers: RDMA through `--disaggregation-ib-device` where an HCA exists, TCP
otherwise (logged loudly at start, never silently).

Packages: `mooncake-transfer-engine` (CUDA hosts) or `mooncake-transfer-engine-non-cuda` (which
needs Debian's `libibverbs1 libnl-3-200 libnl-route-3-200`).
"""

from __future__ import annotations

import logging
import os

from dsaserve.disaggregation.transfer.base import Kinds, Segment, TransferEngine, TransferError

logger = logging.getLogger(__name__)


def _engine_class():
    try:
        from mooncake.engine import TransferEngine as Engine
    except ImportError as e:
        raise ImportError(
            "--disaggregation-transfer-backend mooncake needs Mooncake: `pip install "
            "mooncake-transfer-engine` (CUDA) or `mooncake-transfer-engine-non-cuda` (with "
            f"libibverbs1 libnl-3-200 libnl-route-3-200): {e}"
        ) from e
    return Engine


def _has_hca() -> bool:
    return os.path.isdir("/sys/class/infiniband") and bool(os.listdir("/sys/class/infiniband"))


class MooncakeEngine(TransferEngine):
    name = "mooncake"

    def __init__(self, agent_name: str, host: str, ib_device: str | None) -> None:
        self.engine = _engine_class()()
        self.protocol = "rdma" if (ib_device or _has_hca()) else "tcp"
        if self.protocol == "tcp":
            logger.warning(
                "MOONCAKE IS USING TCP, NOT RDMA: no InfiniBand/RoCE device (%s); KV moves over "
                "TCP sockets (slow; its sockets listen on all interfaces)",
                ib_device or "/sys/class/infiniband is empty",
            )
        code = self.engine.initialize(host, "P2PHANDSHAKE", self.protocol, ib_device or "")
        if code != 0:
            raise RuntimeError(f"Mooncake failed to initialise ({self.protocol}): code {code}")
        self.session = f"{host}:{self.engine.get_rpc_port()}"

    def register(self, regions: list[tuple[int, int, str]]) -> None:
        for address, size, _kind in regions:
            if self.engine.register_memory(address, size) != 0:
                raise RuntimeError(f"Mooncake could not register {size} bytes at {address:#x}")

    def metadata(self) -> bytes:
        return self.session.encode()

    def add_peer(self, metadata: bytes) -> str:
        return metadata.decode()

    def _write(self, peer: str, segments: list[Segment], tag: bytes, kinds: Kinds) -> None:
        srcs, dsts, lens = (list(column) for column in zip(*segments))
        code = self.engine.batch_transfer_sync_write(peer, srcs, dsts, lens)
        if code < 0:
            raise TransferError(f"Mooncake write to {peer} failed (code {code})")
