"""Join the ranks with torch.distributed (NCCL on CUDA, gloo on CPU) and build their groups.

The rendezvous address is `--dist-init-addr HOST:PORT`, or on one node a port the OS picks.
`init_rank` joins the world as one rank and returns its `ParallelState` (the attention groups, a
gloo group beside NCCL, the shared-memory collectives of one node's CPU ranks). Which process runs
which rank is the runtime's (runtime/ranks.py).
"""

from __future__ import annotations

import datetime
import socket
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from dsaserve.distributed.parallel_state import ParallelSizes, ParallelState
from dsaserve.distributed.shm_comm import ShmGroup
from dsaserve.distributed.shm_comm import supported as shm_supported


class RendezvousError(RuntimeError):
    """The rendezvous address could not be reached or bound; the message names it."""


@dataclass(frozen=True)
class Endpoint:
    host: str
    port: int

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


def endpoint(args: Any) -> Endpoint:
    """--dist-init-addr HOST:PORT, else this host and a port the OS picks."""
    if args.dist_init_addr:
        host, _, port = args.dist_init_addr.rpartition(":")
        return Endpoint(host.strip("[]"), int(port))
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return Endpoint("127.0.0.1", probe.getsockname()[1])


def wait_reachable(where: Endpoint, timeout: float) -> None:
    """Node n > 0: wait until node 0's rendezvous port answers, or fail naming it."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((where.host, where.port), timeout=1.0):
                return
        except OSError:
            if time.monotonic() >= deadline:
                raise RendezvousError(
                    f"--dist-init-addr {where}: no rank 0 answered there within {timeout:g}s"
                ) from None
            time.sleep(0.2)


def init_rank(args: Any, rank: int, where: Endpoint, device_type: str) -> ParallelState:
    """Join the process group as `rank` and build this rank's groups."""
    sizes = ParallelSizes.from_args(args)
    backend = "nccl" if device_type == "cuda" else "gloo"
    if device_type == "cuda":
        torch.cuda.set_device(rank % sizes.ranks_per_node)
    timeout = datetime.timedelta(seconds=args.watchdog_timeout)
    try:
        dist.init_process_group(backend, init_method=f"tcp://{where}", rank=rank,
                                world_size=sizes.tp, timeout=timeout)  # fmt: skip
    except RuntimeError as e:  # DistStoreError / DistNetworkError: nobody met us there in time
        raise RendezvousError(
            f"--dist-init-addr {where}: the ranks did not meet within {timeout.total_seconds():g}s"
            f" ({type(e).__name__}: {' '.join(str(e).split())[:200]})"
        ) from None
    cpu_group = dist.new_group(backend="gloo", timeout=timeout) if backend == "nccl" else None
    state = ParallelState(sizes, rank, world_group=None, cpu_group=cpu_group)
    if 1 < sizes.attn_tp < sizes.tp:
        for group in range(sizes.groups):
            ranks = list(range(sizes.leader(group), sizes.leader(group) + sizes.attn_tp))
            device_group = dist.new_group(ranks, timeout=timeout)
            host_group = dist.new_group(ranks, backend="gloo", timeout=timeout)
            if rank in ranks:
                state.attn_group, state.attn_cpu_group = device_group, host_group
    elif sizes.attn_tp == sizes.tp:
        state.attn_group, state.attn_cpu_group = None, cpu_group
    if shm_supported(device_type, sizes.nnodes) and not args.disable_custom_all_reduce:
        _map_shm(state, args.watchdog_timeout)
    return state


def _map_shm(state: ParallelState, timeout: float) -> None:
    """The shared-memory collectives over the world and this rank's attention group."""
    sizes, rank = state.sizes, state.rank
    state.world_shm = ShmGroup.create(list(range(sizes.tp)), rank, None, timeout)
    if sizes.attn_tp == sizes.tp:
        state.attn_shm = state.world_shm
    elif sizes.attn_tp > 1:
        first = sizes.leader(state.dp_rank)
        ranks = list(range(first, first + sizes.attn_tp))
        state.attn_shm = ShmGroup.create(ranks, rank, state.attn_cpu_group, timeout)
