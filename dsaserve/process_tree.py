"""Processes seen through /proc (Linux): a process's descendants, the processes working in a
folder or holding a file open, and ending a set of them at once.

Used where a process must stop everything it started, grandchildren included (a build's
compiler runs in a process group of its own under ninja), and where a lock file's owner must be
found. Elsewhere (no /proc) every function sees no process, so callers fall back to the pids
they know.
"""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path
from typing import NamedTuple

PROC = Path("/proc")


class Proc(NamedTuple):
    """A process as seen once: its pid and start time (so a reused pid is never signalled)."""

    pid: int
    start: int


def _stat(pid: int | str) -> tuple[str, int, int] | None:
    """(state, parent pid, start time) of a live process, else None."""
    try:
        fields = (PROC / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
        return fields[0], int(fields[1]), int(fields[19])
    except (OSError, ValueError, IndexError):
        return None


def descendants(pid: int) -> list[Proc]:
    """Every live descendant of `pid` (children first), not `pid` itself."""
    children: dict[int, list[Proc]] = {}
    for entry in PROC.glob("[0-9]*"):
        stat = _stat(entry.name)
        if stat is not None and stat[0] != "Z":
            children.setdefault(stat[1], []).append(Proc(int(entry.name), stat[2]))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child.pid)
    return out


def working_in(folder: Path) -> list[Proc]:
    """Processes (of this user) whose working directory is `folder`, other than this one."""
    target = os.path.realpath(folder)
    out = []
    for cwd in PROC.glob("[0-9]*/cwd"):
        with contextlib.suppress(OSError, ValueError):
            pid = int(cwd.parent.name)
            stat = _stat(pid)
            if pid != os.getpid() and stat is not None and os.readlink(cwd) == target:
                out.append(Proc(pid, stat[2]))
    return out


def holding(path: Path) -> list[int]:
    """Processes (of this user) that have `path` open."""
    target = os.path.realpath(path)
    out = set()
    for fd in PROC.glob("[0-9]*/fd/*"):
        with contextlib.suppress(OSError, ValueError):
            if os.readlink(fd) == target:
                out.add(int(fd.parent.parent.name))
    return sorted(out)


def kill_all(procs: list[Proc], sig: int = signal.SIGKILL) -> list[int]:
    """Send `sig` to each of `procs` still running (same pid, same start time); the pids it
    reached. Listing first and signalling after keeps a grandchild whose parent dies first."""
    reached = []
    for proc in procs:
        stat = _stat(proc.pid)
        if stat is None or stat[2] != proc.start or stat[0] == "Z":
            continue
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(proc.pid, sig)
            reached.append(proc.pid)
    return reached
