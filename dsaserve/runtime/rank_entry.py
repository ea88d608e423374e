"""`python -m dsaserve.runtime.rank_entry`: a spawned rank. Its `RankJob` comes pickled on stdin
from the process that started it (ranks.RankProcess); it exits when that process goes away."""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import sys
import threading
import time

import torch.distributed as dist

from dsaserve.runtime import heartbeat
from dsaserve.runtime.follower import run_rank
from dsaserve.runtime.ranks import WATCH_INTERVAL_S, RankJob


def watch_parent(parent_pid: int) -> None:
    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(WATCH_INTERVAL_S)
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="dsaserve-parent-watch").start()


def rank_main(job: RankJob) -> None:
    """Entry point of a spawned rank: a follower, or (DP attention) another group's leader."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    watch_parent(job.parent_pid)
    if job.paths is not None:  # a rank of the server's node 0: /health watches it
        heartbeat.start_beating(job.paths.heartbeat, job.paths.first_slot + job.rank)
    code = 1
    try:
        code = run_rank(job)
    except Exception as e:
        print(f"dsaserve rank {job.rank}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
    with contextlib.suppress(Exception):
        dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(code)


if __name__ == "__main__":
    rank_main(pickle.loads(sys.stdin.buffer.read()))
