"""This node's rank processes, seen from the process that starts them: spawn, watch, stop.

Rank 0 (the engine process, or the offline `LLM`'s process) spawns this node's other ranks and
joins them as rank 0 (distributed/rendezvous.py); on node n > 0, `dsaserve serve --node-rank n`
spawns them all and only waits (node.py). A rank exits when its parent goes away (rank_entry.py);
the parent ends every child when one of them dies, so no process is left.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from dsaserve.args import ServerArgs
from dsaserve.distributed.parallel_state import ParallelSizes, ParallelState
from dsaserve.distributed.rendezvous import Endpoint, endpoint, init_rank, listen
from dsaserve.runtime.ipc import IpcPaths

WATCH_INTERVAL_S = 0.2


@dataclass(frozen=True)
class RankJob:
    """What a spawned rank is told, pickled on its stdin. `paths`: the server's IPC folder (the
    heartbeat file, runtime/heartbeat.py; under DP attention the first rank of each group is an
    engine with its own request socket, built by `factory`)."""

    args: ServerArgs
    rank: int
    where: Endpoint
    parent_pid: int
    paths: IpcPaths | None = None
    factory: Callable[..., Any] | None = None  # runtime/engine_process.py's EngineFactory


BIND_ENV = "SGLANG_CPU_OMP_THREADS_BIND"  # SGLang's name: "0-41|42-83", a core range per rank


def rank_threads(args: ServerArgs, parallel: ParallelState) -> None:
    """This rank's torch threads (which the native decode layers use too): --threads (per
    rank), else OMP_NUM_THREADS, else the cores it is bound to, else this node's cores shared
    among its ranks. With SGLANG_CPU_OMP_THREADS_BIND the rank is first bound to its range of
    cores (the node's rank r to range r), so every thread it starts after stays there: on a
    two-socket server, one rank per NUMA node streams its weights from its own memory."""
    sizes = parallel.sizes
    cores = bound_cores(os.environ.get(BIND_ENV, ""), parallel.rank % sizes.ranks_per_node,
                        sizes.ranks_per_node)  # fmt: skip
    if cores:
        os.sched_setaffinity(0, cores)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    elif "OMP_NUM_THREADS" not in os.environ:
        shared = max(1, (os.cpu_count() or 1) // sizes.ranks_per_node)
        torch.set_num_threads(len(cores) if cores else shared)


def bound_cores(spec: str, rank: int, ranks: int) -> list[int]:
    """Rank `rank`'s cores in a SGLANG_CPU_OMP_THREADS_BIND value ("0-3|4-7", each part core
    ids and ranges joined by commas), or [] when unset; a value without a part per rank is
    refused (a rank left unbound would share another's cores)."""
    if not spec.strip():
        return []
    parts = spec.split("|")
    if len(parts) != ranks:
        raise ValueError(f"{BIND_ENV}={spec!r}: {len(parts)} core ranges for {ranks} ranks on "
                         "this node (one per rank, '|'-separated)")  # fmt: skip
    cores: list[int] = []
    for item in parts[rank].split(","):
        first, _, last = item.strip().partition("-")
        if not first.isdigit() or (last and not last.isdigit()):
            raise ValueError(f"{BIND_ENV}={spec!r}: {item!r} is not a core id or range")
        cores += range(int(first), int(last or first) + 1)
    return cores


class RankProcess:
    """A spawned rank: `python -m dsaserve.runtime.rank_entry`, its `RankJob` pickled on
    stdin (so no caller's main module is re-imported, unlike multiprocessing's spawn)."""

    def __init__(self, job: RankJob) -> None:
        self.name = f"rank {job.rank}"
        self.process = subprocess.Popen(
            [sys.executable, "-m", "dsaserve.runtime.rank_entry"], stdin=subprocess.PIPE
        )
        self.process.stdin.write(pickle.dumps(job))
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
        """Wait up to `timeout` for the children (after the engine's STOP round), end the
        rest, and leave the process group (a later start may join a new one)."""
        deadline = time.monotonic() + timeout
        for child in self.children:
            child.join(max(0.0, deadline - time.monotonic()))
        kill_all(self.children)
        if dist.is_initialized():
            dist.destroy_process_group()

    def kill(self) -> None:
        kill_all(self.children)


def kill_all(children: list[RankProcess]) -> None:
    for child in children:
        if child.is_alive():
            child.kill()
    for child in children:
        child.join(3)


def spawn_ranks(args: ServerArgs, ranks: range, where: Endpoint, **job: Any) -> list:
    """Start `ranks` as child processes running rank_entry.py (`job`: RankJob's other fields)."""
    return [RankProcess(RankJob(args, rank, where, os.getpid(), **job)) for rank in ranks]


def start_ranks(
    args: ServerArgs, device_type: str, paths: IpcPaths | None = None, factory: Any = None
) -> LocalRanks:
    """On node 0, from rank 0's process: start ranks 1..ranks_per_node-1, then join as rank 0."""
    sizes = ParallelSizes.from_args(args)
    listener, where = listen(endpoint(args))
    if sizes.nnodes > 1:  # with `--dist-init-addr HOST:0` the other nodes learn the port here
        print(f"dsaserve node 0: rendezvous on {where} (the other nodes: --dist-init-addr "
              f"{where})", flush=True)  # fmt: skip
    try:
        children = spawn_ranks(args, range(1, sizes.ranks_per_node), where, paths=paths,
                               factory=factory)  # fmt: skip
    except BaseException:
        listener.close()
        raise
    try:
        parallel = init_rank(args, 0, where, device_type, listener)
        share_paths(parallel, paths)
        rank_threads(args, parallel)
    except BaseException:
        kill_all(children)
        raise
    watch_children(children, on_death=lambda child: _die(children, child))
    return LocalRanks(parallel, children)


def share_paths(parallel: ParallelState, paths: IpcPaths | None) -> IpcPaths | None:
    """DP attention over several nodes: rank 0 tells every rank the API process's socket
    addresses (TCP on node 0; the group leaders on other nodes have none in their RankJob).
    Every rank calls it once, right after joining."""
    if parallel.sizes.nnodes == 1 or parallel.sizes.groups == 1:
        return paths
    box = [paths]
    dist.broadcast_object_list(box, src=0, group=parallel.cpu_group)
    return box[0]


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
