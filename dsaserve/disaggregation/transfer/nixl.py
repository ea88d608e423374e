"""NIXL (UCX) transfers. On a CPU host UCX moves host memory between processes over TCP and
shared memory: `UCX_TLS=tcp,sm,self` (plus `UCX_NET_DEVICES=lo` on one machine).

NIXL ships as `nixl` (which depends on a CUDA torch) and as per-CUDA variant packages
(`nixl-cu12`, `nixl-cu13`) that import as `nixl_cu12` etc.; any of them works here.
"""

from __future__ import annotations

import importlib
import time
from typing import Any

import numpy as np
import torch

from dsaserve.disaggregation.transfer.base import Kinds, Segment, TransferEngine, TransferError

WRITE_TIMEOUT_S = 60.0
PROGRESS_WAIT_US = 100_000  # the progress thread's longest sleep between UCX events
MODULES = ("nixl._api", "nixl_cu12._api", "nixl_cu13._api")


def _api():
    errors = []
    for name in MODULES:
        try:
            return importlib.import_module(name)
        except ImportError as e:
            errors.append(f"{name}: {e}")
    raise ImportError(
        "--disaggregation-transfer-backend nixl needs NIXL: `pip install --no-deps nixl-cu12` "
        "(plus numpy) keeps a CPU torch; " + "; ".join(errors)
    )


def _descs(segments: list[Segment], column: int, kind: str) -> np.ndarray:
    """[address, bytes, device id] rows (device 0 on the host; the current GPU for VRAM)."""
    table = np.asarray(segments, dtype=np.uint64)
    device = torch.cuda.current_device() if kind == "VRAM" else 0
    ids = np.full((len(segments), 1), device, dtype=np.uint64)
    return np.ascontiguousarray(np.hstack([table[:, [column, 2]], ids]))


def _agent(api: Any, agent_name: str) -> Any:
    """A NIXL agent whose UCX progress thread sleeps until UCX has an event (or
    PROGRESS_WAIT_US passed). `nixl_agent` sets the thread's wait to 0, and the thread then
    polls without a pause: a core per agent, idle or not (3-5 of them in one PD test module on
    a 2-core machine starved its servers). The thread itself stays: a write into a decode
    completes while the decode is busy stepping or idle (over TCP the receiving side's UCX must
    progress for the bytes to land)."""

    class Config(api.nixlBind.nixlAgentConfig):
        def __setattr__(self, name: str, value: Any) -> None:
            super().__setattr__(name, PROGRESS_WAIT_US if name == "pthrDelay" else value)

    binding = api.nixlBind.nixlAgentConfig
    api.nixlBind.nixlAgentConfig = Config
    try:
        return api.nixl_agent(agent_name, api.nixl_agent_config(backends=["UCX"]))
    finally:
        api.nixlBind.nixlAgentConfig = binding


class NixlEngine(TransferEngine):
    name = "nixl"
    notifies = True

    def __init__(self, agent_name: str, host: str, ib_device: str | None) -> None:
        api = _api()
        self.agent_name = agent_name
        self.agent = _agent(api, agent_name)
        self.registered: list = []
        self.pending: list[bytes] = []

    def register(self, regions: list[tuple[int, int, str]]) -> None:
        for address, size, kind in regions:
            device = torch.cuda.current_device() if kind == "VRAM" else 0
            self.registered.append(self.agent.register_memory([(address, size, device, "")], kind))

    def metadata(self) -> bytes:
        return self.agent.get_agent_metadata()

    def add_peer(self, metadata: bytes) -> str:
        peer = self.agent.add_remote_agent(metadata)
        return peer.decode() if isinstance(peer, bytes) else str(peer)

    def remove_peer(self, peer: str) -> None:
        try:
            self.agent.remove_remote_agent(peer)
        except Exception:  # already gone
            pass

    def _write(self, peer: str, segments: list[Segment], tag: bytes, kinds: Kinds) -> None:
        local = self.agent.get_xfer_descs(_descs(segments, 0, kinds[0]), kinds[0])
        remote = self.agent.get_xfer_descs(_descs(segments, 1, kinds[1]), kinds[1])
        try:
            handle = self.agent.initialize_xfer("WRITE", local, remote, peer, tag)
        except Exception as e:
            raise TransferError(f"NIXL could not start the write to {peer}: {e}") from e
        try:
            state = self.agent.transfer(handle)
            deadline = time.monotonic() + WRITE_TIMEOUT_S
            while state not in ("DONE", "ERR") and time.monotonic() < deadline:
                state = self.agent.check_xfer_state(handle)
            if state != "DONE":
                raise TransferError(f"NIXL write to {peer} ended in state {state}")
        except TransferError:
            raise
        except Exception as e:
            raise TransferError(f"NIXL write to {peer} failed: {e}") from e
        finally:
            try:
                self.agent.release_xfer_handle(handle)
            except Exception:
                pass

    def notifications(self) -> list[bytes]:
        notes = self.agent.get_new_notifs()
        return [tag for tags in notes.values() for tag in tags]
