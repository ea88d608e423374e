"""Join the ranks with torch.distributed (NCCL on CUDA, gloo on CPU) and build their groups.

The rendezvous address is `--dist-init-addr HOST:PORT`, or on one node 127.0.0.1 and a port the
OS picks. `init_rank` joins the world as one rank and returns its `ParallelState` (the attention
groups, a gloo group beside NCCL, the shared-memory collectives of one node's CPU ranks). Which
process runs which rank is the runtime's (runtime/ranks.py).

Where the ranks listen (docs/server.md, "Ports"): rank 0's torch.distributed store listens on the
rendezvous address only (PyTorch's own store would listen on every interface): on one node that
is loopback, so no other machine can reach it. gloo's pairs bind the interface that holds (or
reaches) that address (`GLOO_SOCKET_IFNAME`, unless it is set), not whatever the hostname
resolves to. The store's keys live under a name derived from the cluster secret; neither the
store nor gloo authenticates a connection, so beyond loopback runtime/preflight.py refuses a
`--dist-init-addr` without the secret, and the network between the nodes must be trusted.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from dsaserve.cluster.addresses import interface_of, is_local_address, route_source
from dsaserve.cluster.secret import cluster_secret, derive
from dsaserve.distributed.parallel_state import ParallelSizes, ParallelState
from dsaserve.distributed.shm_comm import ShmGroup
from dsaserve.distributed.shm_comm import supported as shm_supported

logger = logging.getLogger(__name__)


class RendezvousError(RuntimeError):
    """The rendezvous address could not be reached or bound; the message names it."""


@dataclass(frozen=True)
class Endpoint:
    host: str
    port: int

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


def endpoint(args: Any) -> Endpoint:
    """--dist-init-addr HOST:PORT, else loopback and port 0 (rank 0's `listen` takes a port the
    OS picks; on node 0 `--dist-init-addr HOST:0` does the same)."""
    if args.dist_init_addr:
        host, _, port = args.dist_init_addr.rpartition(":")
        return Endpoint(host.strip("[]"), int(port))
    return Endpoint("127.0.0.1", 0)


def listen(where: Endpoint) -> tuple[socket.socket, Endpoint]:
    """Rank 0: the store's listening socket, bound before any other rank is told the address
    (a port probed, closed and bound again later could be taken meanwhile), and the endpoint
    with the port it holds."""
    listener = _listen(where)
    return listener, Endpoint(where.host, listener.getsockname()[1])


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


def init_rank(args: Any, rank: int, where: Endpoint, device_type: str,
              listener: socket.socket | None = None) -> ParallelState:  # fmt: skip
    """Join the process group as `rank` and build this rank's groups (rank 0: serving the store
    on `listener`, from `listen`)."""
    sizes = ParallelSizes.from_args(args)
    backend = "nccl" if device_type == "cuda" else "gloo"
    if device_type == "cuda":
        torch.cuda.set_device(rank % sizes.ranks_per_node)
    timeout = datetime.timedelta(seconds=args.watchdog_timeout)
    _pin_gloo_interface(where.host)
    try:
        store = rendezvous_store(args, where, rank, sizes.tp, timeout, listener)
        dist.init_process_group(backend, store=store, rank=rank, world_size=sizes.tp,
                                timeout=timeout)  # fmt: skip
    except RendezvousError:
        raise
    except RuntimeError as e:  # DistStoreError / DistNetworkError: nobody met us there in time
        raise RendezvousError(
            f"--dist-init-addr {where}: the ranks did not meet within {timeout.total_seconds():g}s"
            f" ({type(e).__name__}: {' '.join(str(e).split())[:200]})"
        ) from None
    cpu_group = dist.new_group(backend="gloo", timeout=timeout) if backend == "nccl" else None
    state = ParallelState(sizes, rank, world_group=None, cpu_group=cpu_group, store=store)
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


def rendezvous_store(args: Any, where: Endpoint, rank: int, world: int,
                     timeout: datetime.timedelta,
                     listener: socket.socket | None = None) -> dist.Store:  # fmt: skip
    """The ranks' store: rank 0 serves it on `where` alone, the others connect there. Every key
    lives under a namespace derived from the cluster secret, so a process that reaches the port
    without the secret can neither read nor replace the ranks' entries (their gloo addresses):
    it cannot guess a key, and the store lists none."""
    if rank == 0:
        store = dist.TCPStore(where.host, where.port, world, True, timeout,
                              master_listen_fd=(listener or _listen(where)).detach())  # fmt: skip
    else:
        store = dist.TCPStore(where.host, where.port, world, False, timeout)
    secret = cluster_secret(args)
    namespace = derive(secret, "rendezvous").hex() if secret else "dsaserve"
    return dist.PrefixStore(namespace, store)


def _listen(where: Endpoint) -> socket.socket:
    """A socket listening on the rendezvous address (PyTorch's store would take every one)."""
    family, kind, _, _, address = socket.getaddrinfo(where.host, where.port,
                                                     type=socket.SOCK_STREAM)[0]  # fmt: skip
    listener = socket.socket(family, kind)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind(address)
    except OSError as e:  # e.g. a NAT address that no interface here holds
        if not is_local_address(where.host):
            logger.warning("--dist-init-addr %s is not an address of this machine (%s): the "
                           "store listens on every interface", where, e.strerror)  # fmt: skip
            listener.bind(("::" if family == socket.AF_INET6 else "0.0.0.0", where.port))
        else:
            listener.close()
            raise RendezvousError(f"--dist-init-addr {where}: {e.strerror}") from None
    listener.listen(1024)
    return listener


def _pin_gloo_interface(host: str) -> None:
    """gloo binds the interface that holds `host` (node 0) or reaches it (the other nodes)."""
    if "GLOO_SOCKET_IFNAME" in os.environ:
        return
    local = host if is_local_address(host) else route_source(host)
    name = interface_of(local) if local else None
    if name:
        os.environ["GLOO_SOCKET_IFNAME"] = name


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
