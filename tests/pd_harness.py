"""sglang-router and PD servers for the disaggregation tests.

`running_router` starts the real `sglang_router.launch_router` (its own process group, both host
flags bound to loopback) and waits until it lists every worker healthy; `pd_flags` are the flags
of one prefill or decode `dsaserve serve`, whose HTTP and bootstrap ports the OS picks (`--port
0`, `--disaggregation-bootstrap-port 0`; read back with `_wait_ready` and `bootstrap_port`).
NIXL moves CPU memory over UCX's TCP and shared-memory transports here (`PD_ENV`).
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
ROUTER_PORT_TRIES = 5


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
    """A port free a moment ago; another process may take it before a child binds it. Only for
    what cannot bind 0 itself: sglang-router (`running_router` retries) and bench/."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pd_flags(role: str, *extra: str, bootstrap_port: int = 0) -> list[str]:
    """A role's flags; the prefill's bootstrap port is the OS's unless given (a decode's only
    answers requests whose `bootstrap_port` is null)."""
    return ["--disaggregation-mode", role, "--disaggregation-transfer-backend", "nixl",
            "--disaggregation-bootstrap-port", str(bootstrap_port), "--disaggregation-checksum",
            *extra]  # fmt: skip


def bootstrap_port(prefill: Server) -> int:
    """The port the prefill's bootstrap server bound."""
    reported = stats(prefill.url)
    assert "pd_bootstrap_port" in reported, (reported, prefill.output())
    return reported["pd_bootstrap_port"]


def launch(model: Path, *flags: str, env: dict | None = None, scripts: Path | None = None,
           faults: Path | None = None) -> Server:  # fmt: skip
    """Start a `dsaserve serve` (not waiting); `ready(server)` waits; `stop_all` stops. With
    `scripts`: tests/scripted_engine.py's scripts in front of the real engine; with `faults`:
    tests/pd_faults.py's write hook, its mode read from that file."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **PD_ENV,
                **(env or {})}  # fmt: skip
    serve = [sys.executable, "-m", "dsaserve.cli", "serve"]
    if scripts is not None:
        serve = [sys.executable, str(Path(__file__).with_name("scripted_serve.py")), str(scripts),
                 "real"]  # fmt: skip
    if faults is not None:
        serve = [sys.executable, str(Path(__file__).with_name("pd_fault_server.py")), str(faults)]
    command = [*serve, "--model-path", str(model), "--port", "0", "--max-total-tokens", "4096",
               "--page-size", "16", *flags]  # fmt: skip
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
    """sglang-router refuses `--port 0` and `--prometheus-port 0` ("Port must be > 0"), and an
    external binary cannot be handed a bound socket, so its ports are numbers the OS called free
    a moment ago. If another process binds one first, the router exits with "Address already in
    use" and starts again on new numbers: a lost race costs a retry, never a wrong server."""
    workers = sum(flag.startswith("http") for flag in flags)
    for _ in range(ROUTER_PORT_TRIES):
        router, reader = _start_router(flags)
        try:
            if _wait_router(router, reader, workers):
                break
        except BaseException:
            stop_group(router.process)
            raise
    else:
        raise RuntimeError(f"the router lost {ROUTER_PORT_TRIES} port races in a row")
    try:
        yield router
    finally:
        stop_group(router.process)


def _start_router(flags: tuple[str, ...]) -> tuple[Server, threading.Thread]:
    port, metrics = free_port(), free_port()
    command = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
               "--port", str(port), "--prometheus-host", "127.0.0.1", "--prometheus-port",
               str(metrics), "--worker-startup-check-interval", "1", "--log-level", "warn",
               *flags]  # fmt: skip
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, start_new_session=True)  # fmt: skip
    router = Server(f"http://127.0.0.1:{port}", process)
    reader = threading.Thread(target=lambda: router.log.extend(process.stdout), daemon=True)
    reader.start()
    return router, reader


def _wait_router(router: Server, reader: threading.Thread, workers: int) -> bool:
    """True once the router lists all `workers` as healthy (it adds them by background jobs, so
    `/v1/models` answers once the first is in, and on a loaded machine a request sent then finds
    no prefill worker yet: 503 "No prefill workers available"); False when it exited because a
    port was taken."""
    deadline, listed = time.monotonic() + ROUTER_START_S, None  # hang guard
    while time.monotonic() < deadline:
        if router.process.poll() is not None:
            reader.join(10)  # its last words
            if "Address already in use" in "".join(router.log):
                return False
            break
        with contextlib.suppress(httpx.HTTPError, ValueError):
            listed = httpx.get(router.url + "/workers", timeout=2).json()["workers"]
            if sum(w.get("is_healthy", False) for w in listed) >= workers:
                return True
        time.sleep(0.2)
    raise RuntimeError(f"router did not list {workers} healthy workers ({listed}):\n"
                       + "".join(router.log[-50:]))  # fmt: skip


def stats(url: str) -> dict:
    return httpx.get(url + "/get_server_info", timeout=30).json()["internal_states"][0]


def idle(url: str) -> bool:
    """No running, waiting or half-transferred request, and no KV held outside the cache."""
    s = stats(url)
    return (s["num_running"], s["num_waiting"], s.get("pd_rooms_active", 0),
            s["kv_used_tokens"]) == (0, 0, 0, 0)  # fmt: skip
