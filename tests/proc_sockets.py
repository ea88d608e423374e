"""What /proc says about a process's sockets (Linux), for the tests of what the ranks open."""

from __future__ import annotations

import contextlib
import os
import socket
from pathlib import Path


def socket_inodes(pid: int) -> set[str]:
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            target = fd.readlink().as_posix()
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    return inodes


def listening(pids: list[int]) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket these processes listen on (/proc/net/tcp{,6})."""
    inodes = set().union(*(socket_inodes(pid) for pid in pids))
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # LISTEN
                address, port = fields[1].rsplit(":", 1)
                packed = bytes.fromhex(address)
                if len(packed) == 4:
                    host = socket.inet_ntop(socket.AF_INET, packed[::-1])
                else:  # four little-endian words
                    words = b"".join(packed[i : i + 4][::-1] for i in range(0, 16, 4))
                    host = socket.inet_ntop(socket.AF_INET6, words)
                found.append((host, int(port, 16)))
    return found


def ipc_folder(pid: int) -> str:
    """The folder of the API process's ipc:// sockets (/proc/net/unix, by its sockets' inodes)."""
    inodes = socket_inodes(pid)
    for line in Path("/proc/net/unix").read_text().splitlines()[1:]:
        fields = line.split()
        if len(fields) > 7 and fields[6] in inodes and "dsaserve-ipc-" in fields[7]:
            return os.path.dirname(fields[7])
    raise AssertionError("no ipc:// socket of the API process")


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
