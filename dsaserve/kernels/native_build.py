"""First-use native builds (`torch.utils.cpp_extension`) that never wait silently.

`load` builds and imports a C++ extension under a lock of our own, next to the build folder:
- the lock is an `flock` with its owner's pid written in it, emptied on release: the kernel
  lets go of it when its owner dies, so a lock whose owner is gone is taken over at once, and
  what the dead build left is cleared (torch's own `lock` file, which nobody holds any more and
  on which torch would wait forever, and its compiler if it is still running), each said in
  the log;
- a live owner is waited on with a log line naming it and how long it has been building, and
  given up on after `timeout_s` (the caller then runs without the extension);
- the build itself is stopped after `timeout_s` (its ninja and compilers killed), and a small
  reaper process in its own session kills the compiler if this process dies mid-build (ninja
  puts each compiler in a process group of its own, which no signal to ours reaches).
A build that cannot run (no compiler), fails or times out raises `BuildFailed` naming why.
The timeout is `DSASERVE_NATIVE_BUILD_TIMEOUT` seconds (default 600).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import ModuleType

from dsaserve import process_tree

logger = logging.getLogger(__name__)

TIMEOUT_S = float(os.environ.get("DSASERVE_NATIVE_BUILD_TIMEOUT", "600"))
WAIT_LOG_EVERY_S = 15.0
POLL_S = 0.1
# Runs in its own session while a build runs; stdin closes without "done" when the builder dies:
# then every process still working in the build folder (the orphaned compilers) is killed.
REAPER = """
import os, signal, sys, time
if sys.stdin.buffer.read() == b"done":
    sys.exit(0)
folder = os.path.realpath(sys.argv[1])
quiet_since = time.monotonic()
while time.monotonic() - quiet_since < 1.0:
    for cwd in os.listdir("/proc"):
        try:
            if cwd.isdigit() and os.readlink(f"/proc/{cwd}/cwd") == folder:
                os.kill(int(cwd), signal.SIGKILL)
                quiet_since = time.monotonic()
        except OSError:
            pass
    time.sleep(0.05)
"""


class BuildFailed(RuntimeError):
    """The extension cannot be had; the message says why (no compiler, compile error, ...)."""


def build_directory(name: str) -> Path:
    """torch's folder for extension `name`: $TORCH_EXTENSIONS_DIR/name, else under its cache."""
    from torch.utils import cpp_extension

    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root is None:
        tag = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
        root = os.path.join(cpp_extension.get_default_build_root(), f"{tag}_cpu")
    return Path(root) / name


def load_or_none(name: str, source: Path, what: str, unavailable: str) -> ModuleType | None:
    """`load` for the machine it runs on (-O3 -march=native), or None after one warning
    "`unavailable` (why)" naming the fallback, where it cannot be built."""
    try:
        return load(name, source, ["-O3", "-march=native"], what)
    except BuildFailed as exc:
        logger.warning("%s (%s)", unavailable, exc)
        return None


def load(name: str, source: Path, cflags: list[str], what: str,
         timeout_s: float = TIMEOUT_S) -> ModuleType:  # fmt: skip
    """Build (when needed) and import extension `name` from `source`; `what` names it in the
    log ("the native decode layers"). Raises BuildFailed."""
    _check_tools()
    folder = build_directory(name)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        return _load_locked(name, source, cflags, what, folder, timeout_s)
    except OSError as e:  # a build folder it cannot write, a lock it cannot open
        raise BuildFailed(f"cannot build in {folder}: {e}") from e


def _load_locked(name: str, source: Path, cflags: list[str], what: str, folder: Path,
                 timeout_s: float) -> ModuleType:  # fmt: skip
    deadline = time.monotonic() + timeout_s
    with BuildLock(folder / "dsaserve.lock", what, deadline) as lock:
        _clear_leftovers(folder, what, deadline)
        stale = _needs_build(folder / f"{name}.so", source, lock.interrupted)
        if stale:
            logger.info("building %s (%s, ~30 s)", what, stale)
        start = time.monotonic()
        with Watch(folder, deadline, enabled=bool(stale)) as watch:
            try:
                module = _torch_load(name, source, cflags, folder)
            except Exception as e:  # noqa: BLE001 (every build failure means: no extension)
                if watch.timed_out:
                    raise BuildFailed(f"the build timed out after {timeout_s:.0f} s") from e
                raise BuildFailed(f"compile error: {_last_line(e)}") from e
        if stale:
            logger.info("built %s in %.1f s", what, time.monotonic() - start)
        return module


def _torch_load(name: str, source: Path, cflags: list[str], folder: Path) -> ModuleType:
    from torch.utils import cpp_extension

    return cpp_extension.load(name=name, sources=[str(source)], extra_cflags=cflags,
                              build_directory=str(folder), verbose=False)  # fmt: skip


def _check_tools() -> None:
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        raise BuildFailed(f"no C++ compiler: {compiler} is not on PATH")
    if shutil.which("ninja") is None:  # the `ninja` package's binary, outside an activated venv
        with contextlib.suppress(ImportError, AttributeError):
            import ninja

            os.environ["PATH"] = f"{ninja.BIN_DIR}{os.pathsep}{os.environ.get('PATH', '')}"
    if shutil.which("ninja") is None:
        raise BuildFailed("ninja is not installed (pip install ninja)")


def _needs_build(library: Path, source: Path, interrupted: bool) -> str:
    """Why a build will run ("first start", "the source changed"), or "" when it is cached.
    (torch decides; this only tells the log, and decides whether the build is watched.)"""
    if not library.exists():
        return "first start"
    if interrupted:
        return "the last build was interrupted"
    if library.stat().st_mtime < source.stat().st_mtime:
        return "the source changed"
    return ""


def _clear_leftovers(folder: Path, what: str, deadline: float) -> None:
    """Under our lock: torch's lock file with no holder is stale (its builder was killed), and
    a process still working in the folder is that builder's orphaned compiler."""
    torch_lock = folder / "lock"
    waited = Waiting(f"torch's build lock {torch_lock}")
    while torch_lock.exists():
        holders = process_tree.holding(torch_lock)
        if not holders:
            with contextlib.suppress(FileNotFoundError):
                torch_lock.unlink()
            logger.warning("removed the stale build lock %s (its build was killed; no process "
                           "holds it)", torch_lock)  # fmt: skip
            break
        if time.monotonic() > deadline:
            raise BuildFailed(f"{torch_lock} is held by pid {holders[0]} past the timeout")
        waited.tick(holders[0])
        time.sleep(POLL_S)
    orphans = process_tree.kill_all(process_tree.working_in(folder))
    if orphans:
        logger.warning("stopped the compiler of an interrupted build of %s (pid %s)", what,
                       ", ".join(map(str, orphans)))  # fmt: skip


class Waiting:
    """Log lines for a wait on someone else's build: at once, then every WAIT_LOG_EVERY_S."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.start = time.monotonic()
        self.logged = -WAIT_LOG_EVERY_S

    def tick(self, owner: int, owner_since: float | None = None) -> None:
        now = time.monotonic()
        if now - self.logged < WAIT_LOG_EVERY_S:
            return
        self.logged = now
        running = f", building for {time.time() - owner_since:.0f} s" if owner_since else ""
        logger.warning("waiting for %s (owner pid %d%s); waited %.0f s", self.what, owner,
                       running, now - self.start)  # fmt: skip


class BuildLock:
    """An flock on `path` holding "pid start-time"; emptied when released."""

    def __init__(self, path: Path, what: str, deadline: float) -> None:
        self.path = path
        self.what = what
        self.deadline = deadline
        self.fd = -1
        self.interrupted = False  # the last owner died holding the lock

    def __enter__(self) -> BuildLock:
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        waited = Waiting(f"another build of {self.what} ({self.path})")
        while not self._try_lock():
            owner, since = self._owner()
            if time.monotonic() > self.deadline:
                os.close(self.fd)
                raise BuildFailed(f"another build (pid {owner}) was still running at the timeout")
            waited.tick(owner, since)
            time.sleep(POLL_S)
        owner, since = self._owner()
        self.interrupted = bool(owner) and owner != os.getpid()
        if self.interrupted:  # a released lock is empty: its owner died holding it
            age = f", started {time.time() - since:.0f} s ago" if since else ""
            logger.warning("the last build of %s (pid %d%s) was interrupted: its process is gone; "
                           "took over its lock %s", self.what, owner, age, self.path)  # fmt: skip
        self._write(f"{os.getpid()} {time.time():.3f}\n")
        return self

    def __exit__(self, *exc: object) -> None:
        with contextlib.suppress(OSError):
            self._write("")
        os.close(self.fd)  # closing releases the flock

    def _try_lock(self) -> bool:
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        return True

    def _owner(self) -> tuple[int, float | None]:
        try:
            pid, since = os.pread(self.fd, 64, 0).decode().split()
            return int(pid), float(since)
        except ValueError:
            return 0, None

    def _write(self, text: str) -> None:
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, text.encode(), 0)
        os.fsync(self.fd)


class Watch:
    """While a build runs: a timer that kills it at the deadline, and the reaper (see REAPER)."""

    def __init__(self, folder: Path, deadline: float, enabled: bool) -> None:
        self.folder = folder
        self.deadline = deadline
        self.enabled = enabled
        self.timed_out = False
        self.done = threading.Event()
        self.reaper: subprocess.Popen | None = None

    def __enter__(self) -> Watch:
        self.thread = threading.Thread(target=self._run, name="native-build-watch", daemon=True)
        self.thread.start()
        if self.enabled:
            self.reaper = subprocess.Popen([sys.executable, "-I", "-S", "-c", REAPER,
                                            str(self.folder)], stdin=subprocess.PIPE,
                                           start_new_session=True)  # fmt: skip
        return self

    def __exit__(self, *exc: object) -> None:
        self.done.set()
        self.thread.join()
        # Here also on SystemExit / KeyboardInterrupt mid-build: nothing may outlive us.
        process_tree.kill_all(process_tree.working_in(self.folder))
        if self.reaper is not None:
            with contextlib.suppress(OSError):
                self.reaper.communicate(b"done", timeout=5)

    def _run(self) -> None:
        while not self.done.wait(POLL_S):
            if time.monotonic() > self.deadline:
                self.timed_out = True
                process_tree.kill_all(process_tree.working_in(self.folder))


def _last_line(error: Exception) -> str:
    """The compiler's first `error:` line, else the message's last line."""
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    errors = [line for line in lines if ": error:" in line or ": fatal error:" in line]
    return (errors[0] if errors else lines[-1] if lines else type(error).__name__)[:300]
