"""Start this node's ranks and join them with torch.distributed (NCCL on CUDA, gloo on CPU).

Rank 0 (the engine process, or the offline `LLM`'s process) spawns this node's other ranks; on
node n > 0, `dsaserve serve --node-rank n` spawns them all and only waits. The rendezvous
address is `--dist-init-addr HOST:PORT`, or on one node a port the OS picks. A rank exits when
its parent goes away; the parent ends every child when one of them dies, so no process is left.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import pickle
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from dsaserve.distributed.parallel_state import ParallelSizes, ParallelState
from dsaserve.distributed.shm_comm import ShmGroup
from dsaserve.distributed.shm_comm import supported as shm_supported

logger = logging.getLogger(__name__)
WATCH_INTERVAL_S = 0.2


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


def rank_threads(sizes: ParallelSizes) -> None:
    """Share this machine's cores among the node's ranks (OMP_NUM_THREADS wins when set)."""
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // sizes.ranks_per_node))


class RankProcess:
    """A spawned rank: `python -m dsaserve.runtime.rank_entry`, its arguments pickled on
    stdin (so no caller's main module is re-imported, unlike multiprocessing's spawn)."""

    def __init__(self, rank: int, payload: tuple) -> None:
        self.name = f"rank {rank}"
        self.process = subprocess.Popen(
            [sys.executable, "-m", "dsaserve.runtime.rank_entry"], stdin=subprocess.PIPE
        )
        self.process.stdin.write(pickle.dumps(payload))
        self.process.stdin.close()

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def exitcode(self) -> int | None:
        return self.process.poll()

    def is_alive(self) -> bool:
        return self.process.poll() is None

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.process.kill()

    def join(self, timeout: float | None = None) -> None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout)


@dataclass
class LocalRanks:
    """Rank 0's view of the ranks it started: its own state and the child processes."""

    parallel: ParallelState
    children: list[RankProcess]

    def stop(self, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        for child in self.children:
            child.join(max(0.0, deadline - time.monotonic()))
        kill_all(self.children)


def kill_all(children: list[RankProcess]) -> None:
    for child in children:
        if child.is_alive():
            child.kill()
    for child in children:
        child.join(3)


def spawn_ranks(args: Any, ranks: range, where: Endpoint, extra: Any = None) -> list:
    """Start `ranks` as child processes running `rank_main`."""
    return [RankProcess(rank, (args, rank, where, extra, os.getpid())) for rank in ranks]


def start_ranks(args: Any, device_type: str, extra: Any = None) -> LocalRanks:
    """On node 0, from rank 0's process: start ranks 1..ranks_per_node-1, then join as rank 0."""
    sizes = ParallelSizes.from_args(args)
    where = endpoint(args)
    children = spawn_ranks(args, range(1, sizes.ranks_per_node), where, extra)
    try:
        parallel = init_rank(args, 0, where, device_type)
    except BaseException:
        kill_all(children)
        raise
    watch_children(children, on_death=lambda child: _die(children, child))
    return LocalRanks(parallel, children)


def watch_children(children: list, on_death: Callable[[Any], None]) -> None:
    def watch() -> None:
        while True:
            time.sleep(WATCH_INTERVAL_S)
            for child in children:
                if not child.is_alive() and child.exitcode not in (0, None):
                    on_death(child)
                    return

    threading.Thread(target=watch, daemon=True, name="dsaserve-rank-watch").start()


def _die(children: list, dead: Any) -> None:
    print(f"dsaserve: {dead.name} exited with code {dead.exitcode}; stopping every rank",
          file=sys.stderr, flush=True)  # fmt: skip
    kill_all(children)
    os._exit(1)


def watch_parent(parent_pid: int) -> None:
    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(WATCH_INTERVAL_S)
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="dsaserve-parent-watch").start()


def rank_main(args: Any, rank: int, where: Endpoint, extra: Any, parent_pid: int) -> None:
    """Entry point of a spawned rank: a follower, or (DP attention) another group's leader."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    watch_parent(parent_pid)
    from dsaserve.runtime.follower import run_rank

    code = 1
    try:
        code = run_rank(args, rank, where, extra)
    except Exception as e:
        print(f"dsaserve rank {rank}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
    with contextlib.suppress(Exception):
        dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(code)
