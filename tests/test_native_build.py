"""First-use native builds never wait silently (dsaserve/kernels/native_build.py).

On a small extension (pybind11 only: seconds to build): a compile error, a missing compiler and
a build past its timeout each end in BuildFailed naming the cause, with nothing left running; a
lock held by a live build is waited on with a log line naming its owner, then given up on; a lock
whose owner is gone is taken over, torch's stale lock removed and the orphaned compiler stopped,
each said in the log.

Then the real thing: `dsaserve serve` killed during its native decode build, by SIGINT to the API
process alone and by SIGKILL to its whole process group, stops everything (the compiler too), and
the next start says what it found, waits on nothing, builds, and what a start loads first
then finds that build cached.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from server_harness import Server, _wait_ready, group_members, stop_group, wait_for

from dsaserve import process_tree
from dsaserve.kernels import native_build

TINY = """
#include <pybind11/pybind11.h>
int answer() { return 42; }
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("answer", &answer); }
"""
# gcc evaluates this loop at compile time for minutes: a build that only a timeout ends
SLOW = """
constexpr long spin() { long x = 0; for (long i = 0; i < 4000000000L; i++) x += i % 7; return x; }
static_assert(spin() > 0);
"""
SLOW_FLAGS = ["-fconstexpr-loop-limit=2147483647", "-fconstexpr-ops-limit=4294967296000"]
LOGGER = "dsaserve.kernels.native_build"


@pytest.fixture
def extensions(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    return tmp_path / "ext"


def source(tmp_path: Path, text: str, name: str = "tiny.cpp") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_builds_and_loads_then_is_cached(extensions, tmp_path, caplog):
    tiny = source(tmp_path, TINY)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        module = native_build.load("nb_tiny", tiny, [], what="the tiny module")
    assert module.answer() == 42
    assert "building the tiny module (first start, ~30 s)" in caplog.text
    assert re.search(r"built the tiny module in [\d.]+ s", caplog.text)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=LOGGER):
        native_build.load("nb_tiny", tiny, [], what="the tiny module")
    assert "building" not in caplog.text  # cached: said nothing
    assert (extensions / "nb_tiny" / "dsaserve.lock").read_text() == ""  # released


def test_compile_error_names_the_compiler_error(extensions, tmp_path):
    broken = source(tmp_path, TINY.replace("return 42;", "return undeclared_name;"))
    with pytest.raises(
        native_build.BuildFailed, match=r"compile error: .*error: .*undeclared_name"
    ):
        native_build.load("nb_broken", broken, [], what="the broken module")


def test_no_compiler(extensions, tmp_path, monkeypatch):
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-c++"))
    with pytest.raises(native_build.BuildFailed, match="no C\\+\\+ compiler"):
        native_build.load("nb_nocxx", source(tmp_path, TINY), [], what="x")


def test_build_past_its_timeout_is_stopped(extensions, tmp_path):
    # SLOW compiles for minutes: only the 2 s timeout ends it with this message
    with pytest.raises(native_build.BuildFailed, match="timed out after 2 s"):
        native_build.load("nb_slow", source(tmp_path, SLOW), SLOW_FLAGS, what="x", timeout_s=2)
    # its compiler is gone (killed at the timeout; allow the kernel a moment to take it away)
    compilers = process_tree.working_in(extensions / "nb_slow")
    wait_for(lambda: gone(compilers), "the timed-out build's compiler gone")


HOLD = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)
fcntl.flock(fd, fcntl.LOCK_EX)
os.pwrite(fd, f"{os.getpid()} {time.time() - 7}\\n".encode(), 0)  # taken 7 s ago: a time stamp
print("held", flush=True)
time.sleep(60)
"""


def test_a_live_build_is_waited_on_with_its_owner_named(extensions, tmp_path, caplog, monkeypatch):
    folder = extensions / "nb_held"
    folder.mkdir(parents=True)
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(folder / "dsaserve.lock")],
                              stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        monkeypatch.setattr(native_build, "WAIT_LOG_EVERY_S", 0.0)  # a line every poll
        with caplog.at_level(logging.INFO, logger=LOGGER):
            with pytest.raises(native_build.BuildFailed, match=f"pid {holder.pid}"):
                native_build.load("nb_held", source(tmp_path, TINY), [], what="x", timeout_s=3)
    finally:
        holder.kill()
        holder.wait()
    waits = [
        r.getMessage() for r in caplog.records if "waiting for another build" in r.getMessage()
    ]
    assert len(waits) >= 2, caplog.text  # at once, then again while it lasts
    assert f"owner pid {holder.pid}, building for" in waits[0]
    assert re.search(r"waited [\d.]+ s", waits[-1])


def test_a_dead_owners_lock_is_taken_over_and_its_leftovers_cleared(extensions, tmp_path, caplog):
    folder = extensions / "nb_stale"
    folder.mkdir(parents=True)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # a pid that is gone
    (folder / "dsaserve.lock").write_text(f"{dead.pid} {time.time() - 30}\n")  # a time stamp
    (folder / "lock").touch()  # torch's baton, left by a killed build: nobody holds it
    orphan = subprocess.Popen(["sleep", "60"], cwd=folder, start_new_session=True)  # "compiler"
    try:
        with caplog.at_level(logging.INFO, logger=LOGGER):
            module = native_build.load("nb_stale", source(tmp_path, TINY), [], what="the x")
        assert module.answer() == 42
        assert orphan.wait(60) == -signal.SIGKILL  # hang guard
    finally:
        orphan.kill()
    text = caplog.text
    assert f"the last build of the x (pid {dead.pid}, started 30 s ago) was interrupted" in text
    assert f"removed the stale build lock {folder / 'lock'}" in text
    assert f"stopped the compiler of an interrupted build of the x (pid {orphan.pid})" in text


# ---- dsaserve serve, killed during its native decode build --------------------------------

BUILDING = "building the native decode layers"


def launch(model: Path, extensions: Path, **env: str) -> Server:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
           "TORCH_EXTENSIONS_DIR": str(extensions), **env}  # fmt: skip
    command = [sys.executable, "-m", "dsaserve.cli", "serve", "--model-path", str(model),
               "--port", "0", "--max-total-tokens", "2048", "--page-size", "16"]  # fmt: skip
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, env=env, start_new_session=True)  # fmt: skip
    return Server("", process)


def wait_for_compiler(server: Server, folder: Path) -> list:
    """The build's compiler processes, once the log says it builds and they run."""

    def pump() -> None:
        for line in server.process.stdout:
            server.log.append(line)

    def building() -> list | None:
        compilers = process_tree.working_in(folder)
        if BUILDING in server.output() and len(compilers) >= 2:  # ninja and a compiler
            return compilers
        assert server.process.poll() is None, server.output()
        return None

    threading.Thread(target=pump, daemon=True).start()
    return wait_for(building, "a build started (its log line, ninja and a compiler)")


def gone(procs: list) -> bool:
    return not process_tree.kill_all(procs, 0)  # signal 0: who is still there


def test_serve_killed_during_the_native_build_restarts_clean(server_checkpoint, tmp_path):
    extensions = tmp_path / "ext"
    folder = extensions / "dsaserve_cpu_decode"
    # 1. SIGINT to the API process alone (not its group): the start stops, compiler included.
    first = launch(server_checkpoint, extensions)
    try:
        compilers = wait_for_compiler(first, folder)
        os.kill(first.process.pid, signal.SIGINT)
        assert first.process.wait(60) != 0  # hang guard
        wait_for(lambda: gone(compilers), "the compiler gone after the SIGINT")
        wait_for(lambda: not group_members(first.process.pid), "the API process's group gone")
    finally:
        stop_group(first.process)
    assert "stopped during start-up" in first.output()
    assert (folder / "dsaserve.lock").read_text() == "" and not (folder / "lock").exists()
    # 2. The next start builds at once (nothing to wait on); SIGKILL to its whole group: the
    # compiler (in ninja's own process group, which no group signal reaches) is reaped.
    second = launch(server_checkpoint, extensions)
    try:
        compilers = wait_for_compiler(second, folder)
        assert "waiting for" not in second.output() and "interrupted" not in second.output()
        os.killpg(second.process.pid, signal.SIGKILL)
        wait_for(lambda: gone(compilers), "the compiler of the killed build gone")
    finally:
        stop_group(second.process)
    assert (folder / "lock").exists() and (folder / "dsaserve.lock").read_text()  # left behind
    # 3. The third start takes the dead build's lock over and says so, waits on nothing, then
    # builds; what the next start loads first finds that build cached.
    third = start_and_stop(server_checkpoint, extensions)
    log = build_lines(third)
    took_over = re.search(
        r"the last build of the native decode layers \(pid \d+, started \d+ s ago\) "
        r"was interrupted: its process is gone; took over its lock",
        log,
    )
    assert took_over, log
    assert "waiting for" not in third.output(), log  # the dead owner's lock held nothing up
    assert f"removed the stale build lock {folder / 'lock'}" in log, log
    assert f"{BUILDING} (first start, ~30 s)" in log[took_over.end() :], log  # then it built
    assert "unavailable" not in log and "built the native decode layers in" in log, log
    cached = load_in_a_new_process(extensions)
    assert cached.stdout == "loaded\n", cached.stderr
    assert not build_lines(cached.stderr), cached.stderr  # cached: nothing to build or clear


def start_and_stop(model: Path, extensions: Path, **env: str) -> Server:
    """A start until ready, then stopped."""
    server = launch(model, extensions, **env)
    try:
        _wait_ready(server)
        return server
    finally:
        stop_group(server.process)


# What a start loads first (engine/decode/native.py), in a process of its own: the next start's
# build step without the rest of a start (the third start showed serve runs it).
LOAD = """
import logging
logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
from dsaserve.engine.decode import native
print("loaded" if native.extension() is not None else "unavailable")
"""


def load_in_a_new_process(extensions: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_EXTENSIONS_DIR": str(extensions)}
    return subprocess.run([sys.executable, "-c", LOAD], capture_output=True, text=True, env=env,
                          timeout=600)  # fmt: skip


def build_lines(log: Server | str) -> str:
    """What the native build said (and any fallback warning), in a server's log or a text."""
    words = ("native decode", "build lock", "native CPU decode")
    lines = log.splitlines(keepends=True) if isinstance(log, str) else log.log
    return "".join(line for line in lines if any(w in line for w in words))


def test_serve_says_when_it_waits_on_a_live_build(server_checkpoint, tmp_path):
    """A build held by another live process: the start says whose and for how long, then gives
    up at the timeout and serves on the Python path with one warning naming why."""
    folder = tmp_path / "ext" / "dsaserve_cpu_decode"
    folder.mkdir(parents=True)
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(folder / "dsaserve.lock")],
                              stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert holder.stdout.readline().strip() == "held"
    try:
        server = start_and_stop(server_checkpoint, tmp_path / "ext",
                                   DSASERVE_NATIVE_BUILD_TIMEOUT="3")  # fmt: skip
    finally:
        holder.kill()
        holder.wait()
    log = server.output()
    assert re.search(
        rf"waiting for another build of the native decode layers .*owner pid "
        rf"{holder.pid}, building for \d+ s\); waited 0 s",
        log,
    ), log
    assert log.count("native CPU decode unavailable") == 1, log
    assert f"another build (pid {holder.pid}) was still running at the timeout" in log, log


def test_a_build_folder_it_cannot_write_is_a_named_failure(tmp_path, monkeypatch):
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "file"))  # a file: no folder in it
    with pytest.raises(native_build.BuildFailed, match="cannot build in"):
        native_build.load("nb_nowhere", source(tmp_path, TINY), [], what="x")
