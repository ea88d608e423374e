"""Start and stop real `dsaserve serve` subprocesses for the server tests.

`make_server_checkpoint` saves a tiny random GlmMoeDsaForCausalLM whose vocabulary is the embedded
model's tokenizer (GLM special tokens), with the GLM-5-style template from tests/fixtures.
`running_server` starts `dsaserve serve --port 0`, waits for its "ready" line, and always stops the
whole process group (API process and engine) when the block exits.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import httpx

from dsaserve.assets import default_model_path

FIXTURES = Path(__file__).parent / "fixtures"
README = Path(__file__).resolve().parents[1] / "README.md"
READY = re.compile(r"dsaserve ready: (http://\S+)")
START_TIMEOUT_S = 240
BUILD_TIMEOUT_S = 600  # more, while the start says it is building (kernels/native_build.py)
BUILD_START = re.compile(r"building the native decode layers|waiting for another build")
BUILD_END = re.compile(r"built the native decode layers|native CPU decode unavailable")
CONTEXT_LENGTH = 1024
HANG_GUARD_S = 120.0
RENDEZVOUS = re.compile(r"rendezvous on (\S+) ")  # node 0's line (runtime/ranks.py)
T = TypeVar("T")


def make_server_checkpoint(folder: Path, seed: int = 0) -> Path:
    import torch
    from tiny_models import COMMON
    from transformers import AutoTokenizer, GlmMoeDsaConfig, GlmMoeDsaForCausalLM

    folder.mkdir(parents=True, exist_ok=True)
    embedded = default_model_path()
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(embedded / name, folder / name)
    shutil.copy(FIXTURES / "glm5_chat_template.jinja", folder / "chat_template.jinja")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    eos = json.loads((folder / "generation_config.json").read_text())["eos_token_id"]
    torch.manual_seed(seed)
    config = GlmMoeDsaConfig(**{
        **COMMON, "vocab_size": len(tokenizer), "num_hidden_layers": 2,
        "max_position_embeddings": CONTEXT_LENGTH, "eos_token_id": eos,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
    })  # fmt: skip
    GlmMoeDsaForCausalLM(config).eval().save_pretrained(folder)
    return folder


def readme_block(after: str) -> str:
    """The first ```bash block of README.md after the line that starts with `after`."""
    text = README.read_text()
    start = text.index("\n" + after)
    match = re.search(r"```bash\n(.*?)```", text[start:], re.S)
    assert match, f"README.md has no bash block after {after!r}"
    return match.group(1).strip()


@dataclass
class Server:
    url: str
    process: subprocess.Popen
    log: list[str] = field(default_factory=list)

    @property
    def base(self) -> str:
        return self.url + "/v1"

    def output(self) -> str:
        return "".join(self.log[-200:])


def write_scripts(folder: Path, scripts: dict) -> Path:
    path = folder / "scripts.json"
    path.write_text(json.dumps(scripts))
    return path


@contextlib.contextmanager
def running_server(
    model: Path | None,
    *flags: str,
    env: dict | None = None,
    scripts: Path | None = None,
    real_engine: bool = True,
    while_starting: Callable[[Server], None] | None = None,
) -> Iterator[Server]:
    """A `dsaserve serve` subprocess on a free port; always stopped (process group) at exit.
    With `scripts` (or `real_engine=False`) its engine process drives tests/scripted_engine.py's
    double: the scripts in front of the real engine, or alone."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **(env or {})}
    model_flags = [] if model is None else ["--model-path", str(model)]  # None: embedded model
    serve = [sys.executable, "-m", "dsaserve.cli", "serve"]
    if scripts is not None or not real_engine:
        double = [str(scripts or "-"), "real" if real_engine else "alone"]
        serve = [sys.executable, str(Path(__file__).with_name("scripted_serve.py")), *double]
    command = [*serve, *model_flags, "--port", "0", "--max-total-tokens", "4096",
               "--page-size", "16", *flags]  # fmt: skip
    with running_command(command, full_env, while_starting) as server:
        yield server


@contextlib.contextmanager
def running_command(
    command: list[str], env: dict, while_starting: Callable[[Server], None] | None = None
) -> Iterator[Server]:
    """`command` (a `dsaserve serve ... --port 0` line) in its own process group, once it says it
    is ready; the whole group stopped when the block exits, even on failure. `while_starting`
    runs once the process is started, while the harness waits for "ready" (it may start what the
    server needs before it can be ready: node 1 of a two-node layout)."""
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
        start_new_session=True,
    )  # fmt: skip
    server = Server("", process)
    waiter = ThreadPoolExecutor(1)
    try:
        ready = waiter.submit(_wait_ready, server)
        if while_starting is not None:
            while_starting(server)
        server.url = ready.result()
        yield server
    finally:
        stop_group(process)
        waiter.shutdown(wait=False)


def _wait_ready(server: Server) -> str:
    """The server's URL once it says it is ready: within START_TIMEOUT_S, plus the time it says
    it spent building the native decode layers (or waiting on another build) on a busy machine
    (up to BUILD_TIMEOUT_S more)."""
    found: list[str] = []
    ready = threading.Event()
    build: dict[str, float] = {}

    def pump() -> None:
        for line in server.process.stdout:
            server.log.append(line)
            if BUILD_START.search(line):
                build.setdefault("start", time.monotonic())
            if BUILD_END.search(line):
                build.setdefault("end", time.monotonic())
            match = READY.search(line)
            if match and not found:
                found.append(match.group(1))
                ready.set()
        ready.set()

    threading.Thread(target=pump, daemon=True).start()
    start = time.monotonic()
    while not ready.wait(1.0):
        building = build.get("end", time.monotonic()) - build.get("start", time.monotonic())
        limit = START_TIMEOUT_S + min(building, BUILD_TIMEOUT_S)
        if time.monotonic() - start > limit:  # hang guard
            break
    if not found:
        raise RuntimeError(f"server did not start:\n{server.output()}")
    return found[0]


def wait_for(predicate: Callable[[], T], what: str | Callable[[], str],
             timeout: float = HANG_GUARD_S, poll: float = 0.05) -> T:  # fmt: skip
    """Poll `predicate` until it returns something truthy and return that. `timeout` is a hang
    guard (a condition that never comes fails the test, naming `what`), never a bound on speed.
    `what` may be a function, called on failure, to say the state last seen too."""
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        if time.monotonic() >= deadline:
            raise AssertionError(f"waited {timeout:.0f}s, never saw: "
                                 f"{what() if callable(what) else what}")  # fmt: skip
        time.sleep(poll)
    return value


def rendezvous_address(node0: Server) -> str:
    """The address node 0 prints once it holds its rendezvous port (`--dist-init-addr HOST:0`,
    runtime/ranks.py), for the other nodes' commands."""

    def printed() -> str | None:
        assert node0.process.poll() is None, node0.output()
        found = RENDEZVOUS.search(node0.output())
        return found and found.group(1)

    return wait_for(printed, "node 0's rendezvous address", START_TIMEOUT_S)


def wait_unhealthy(server: Server) -> str:
    """/health's 503 message, once it answers 503 (a stopped or lost rank misses its heartbeats
    for runtime/heartbeat.py's STALE_S)."""

    def unhealthy() -> httpx.Response | None:
        answer = httpx.get(server.url + "/health", timeout=10)
        return answer if answer.status_code != 200 else None

    answer = wait_for(unhealthy, "a rank is stopped or gone, /health still 200")
    assert answer.status_code == 503, answer.text
    return answer.json()["error"]["message"]


def stop_group(process: subprocess.Popen, timeout: float = 20.0) -> None:
    """SIGTERM the process group, then SIGKILL whatever is left."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(5)
    deadline = time.monotonic() + 5.0
    while group_members(process.pid) and time.monotonic() < deadline:
        time.sleep(0.05)


def _live(field: int, value: int) -> list[int]:
    """Live (not zombie) processes whose /proc stat `field` (after the name) is `value`."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if fields[0] != "Z" and int(fields[field]) == value:
                found.append(int(stat.parent.name))
    return found


def group_members(pgid: int) -> list[int]:
    """Live processes of a process group, from /proc (Linux)."""
    return _live(2, pgid)


def children(pid: int) -> list[int]:
    """Live child processes of `pid`, from /proc (Linux)."""
    return _live(1, pid)


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True
