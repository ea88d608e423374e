"""The API process's engine processes: spawn them, notice a death, stop them.

One engine process serves the engine (with `--tp N` it starts its own ranks, under DP attention
its groups). `--dp N` without DP attention spawns N of them, SGLang's data-parallel replicas:
each an independent engine of `--tp` ranks with its own request socket (the DP controller,
server/dp_controller.py, dispatches to them). The server is up while every one is: when one
dies the others are ended too and the API answers 503, as when a single engine dies.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import time
from typing import Any

from dsaserve import process_tree
from dsaserve.args import ServerArgs
from dsaserve.distributed.parallel_state import ParallelSizes
from dsaserve.runtime import ipc
from dsaserve.runtime.omp import limit_omp_spinning

ENGINE_STOP_TIMEOUT_S = 10.0
WATCH_INTERVAL_S = 0.2

Process = multiprocessing.process.BaseProcess


class EngineProcesses:
    """The engine processes as one: alive while all are (EngineClient watches `is_alive`)."""

    def __init__(self, processes: list[Process]) -> None:
        self.processes = processes

    def is_alive(self) -> bool:
        return all(p.is_alive() for p in self.processes)

    @property
    def exitcode(self) -> int | None:
        return next((p.exitcode for p in self.processes if not p.is_alive()), None)

    async def end_with_first(self) -> None:
        """When one replica dies, end the others (their ranks too): nothing keeps running
        behind a server that answers 503."""
        while self.is_alive():
            await asyncio.sleep(WATCH_INTERVAL_S)
        for process in self.processes:
            await asyncio.to_thread(_end_now, process)


def default_factory() -> Any:
    """The engine in its --disaggregation-mode role. Its code is imported here, for the spawn:
    the API process never runs a model."""
    from dsaserve.disaggregation.roles import serving_engine

    return serving_engine


def start_engines(args: ServerArgs, paths: ipc.IpcPaths, factory: Any = None) -> EngineProcesses:
    """Spawn the engine process (one per `--dp` replica)."""
    from dsaserve.runtime.engine_process import run_engine_process

    context = multiprocessing.get_context("spawn")
    limit_omp_spinning()  # the engines (and their ranks) import torch after this (runtime/omp.py)
    processes = []
    for replica in range(ParallelSizes.from_args(args).replicas):
        process = context.Process(
            target=run_engine_process, name=f"dsaserve-engine-{replica}",
            args=(args, paths, os.getpid(), factory or default_factory(), replica),
        )  # fmt: skip
        process.start()
        processes.append(process)
    return EngineProcesses(processes)


async def stop_engines(engine: Any, engines: EngineProcesses, started: bool = True) -> None:
    """Ask the engines to stop (`engine`: their EngineClient); terminate, then kill, those that
    do not. An engine still starting has nothing to drain: it is terminated at once (it stops
    its build, if any), and whatever it leaves running (ranks, a compiler) is killed with it."""
    await engine.shutdown()
    deadline = time.monotonic() + (ENGINE_STOP_TIMEOUT_S if started else 0.0)
    while any(p.is_alive() for p in engines.processes) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    for process in engines.processes:
        await asyncio.to_thread(_end_now, process)
    engine.close()


def _end_now(process: Process) -> None:
    """Terminate, then kill, `process` and every process it started."""
    tree = process_tree.descendants(process.pid) if process.pid else []
    if process.is_alive():
        process.terminate()
        process.join(3)
    if process.is_alive():
        tree = process_tree.descendants(process.pid)
        process.kill()
        process.join(3)
    process_tree.kill_all(tree)
