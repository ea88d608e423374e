"""sglang-router and PD servers for the disaggregation tests.

`running_router` starts the real `sglang_router.launch_router` (its own process group, both host
flags bound to loopback, free ports) and waits until it lists every worker healthy; `pd_flags`
are the flags of one prefill or decode `dsaserve serve`. NIXL moves CPU memory over UCX's TCP
and shared-memory transports here (`PD_ENV`).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from server_harness import Server, _wait_ready, stop_group

PD_ENV = {"UCX_TLS": "tcp,sm,self", "UCX_NET_DEVICES": "lo"}
ROUTER_START_S = 60


def nixl_available() -> bool:
    return any(importlib.util.find_spec(m) is not None for m in ("nixl", "nixl_cu12", "nixl_cu13"))


requires_router = pytest.mark.skipif(
    importlib.util.find_spec("sglang_router") is None,
    reason="sglang-router is not installed (pip install sglang-router)",
)
requires_nixl = pytest.mark.skipif(
    not nixl_available(), reason="NIXL is not installed (pip install --no-deps nixl-cu12 numpy)"
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pd_flags(role: str, bootstrap_port: int, *extra: str) -> list[str]:
    return ["--disaggregation-mode", role, "--disaggregation-transfer-backend", "nixl",
            "--disaggregation-bootstrap-port", str(bootstrap_port), "--disaggregation-checksum",
            *extra]  # fmt: skip


def launch(model: Path, *flags: str, env: dict | None = None) -> Server:
    """Start a `dsaserve serve` (not waiting); `ready(server)` waits; `stop_all` stops."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **PD_ENV,
                **(env or {})}  # fmt: skip
    command = [sys.executable, "-m", "dsaserve.cli", "serve", "--model-path", str(model), "--port",
               "0", "--max-total-tokens", "4096", "--page-size", "16", *flags]  # fmt: skip
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, env=full_env, start_new_session=True)  # fmt: skip
    return Server("", process)


@contextlib.contextmanager
def running_servers(specs: list[tuple[Path, list[str], dict | None]]) -> Iterator[list[Server]]:
    """Several servers started at once; every process group is stopped at exit."""
    servers: list[Server] = []
    try:
        servers += [launch(model, *flags, env=env) for model, flags, env in specs]
        for server in servers:
            server.url = _wait_ready(server)
        yield servers
    finally:
        stop_all(servers)


def stop_all(servers: list[Server]) -> None:
    threads = [threading.Thread(target=stop_group, args=(s.process,)) for s in servers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


@contextlib.contextmanager
def running_router(*flags: str) -> Iterator[Server]:
    port, metrics = free_port(), free_port()
    command = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
               "--port", str(port), "--prometheus-host", "127.0.0.1", "--prometheus-port",
               str(metrics), "--worker-startup-check-interval", "1", "--log-level", "warn",
               *flags]  # fmt: skip
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, start_new_session=True)  # fmt: skip
    router = Server(f"http://127.0.0.1:{port}", process)
    threading.Thread(target=lambda: router.log.extend(process.stdout), daemon=True).start()
    try:
        _wait_router(router, sum(flag.startswith("http") for flag in flags))
        yield router
    finally:
        stop_group(process)


def _wait_router(router: Server, workers: int) -> None:
    """Until the router lists all `workers` as healthy: it adds them by background jobs, so
    `/v1/models` answers once the first is in, and on a loaded machine a request sent then
    finds no prefill worker yet (503 "No prefill workers available")."""
    deadline, listed = time.monotonic() + ROUTER_START_S, None
    while time.monotonic() < deadline:
        if router.process.poll() is not None:
            break
        with contextlib.suppress(httpx.HTTPError, ValueError):
            listed = httpx.get(router.url + "/workers", timeout=2).json()["workers"]
            if sum(w.get("is_healthy", False) for w in listed) >= workers:
                return
        time.sleep(0.2)
    raise RuntimeError(f"router did not list {workers} healthy workers ({listed}):\n"
                       + "".join(router.log[-50:]))  # fmt: skip


def stats(url: str) -> dict:
    return httpx.get(url + "/get_server_info", timeout=30).json()["internal_states"][0]


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def idle(url: str) -> bool:
    """No running, waiting or half-transferred request, and no KV held outside the cache."""
    s = stats(url)
    return (s["num_running"], s["num_waiting"], s.get("pd_rooms_active", 0),
            s["kv_used_tokens"]) == (0, 0, 0, 0)  # fmt: skip
