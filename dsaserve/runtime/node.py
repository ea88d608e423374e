"""`dsaserve serve --node-rank N` (N > 0): run this node's ranks only; node 0 serves HTTP.

It waits (up to --watchdog-timeout) for node 0's rendezvous port, starts its ranks (under DP
attention the first rank of each group here is that group's engine, its requests coming from
node 0's API process over TCP), and exits when they do: when node 0 goes away their collectives
fail and they exit; when one of them dies the others are ended, so no process is left here.
"""

from __future__ import annotations

import signal
import sys
import time
from typing import Any

from dsaserve.distributed.parallel_state import ParallelSizes
from dsaserve.distributed.rendezvous import RendezvousError, endpoint, wait_reachable
from dsaserve.runtime.ranks import kill_all, spawn_ranks


def serve_node(args: Any, factory: Any = None) -> int:
    """`factory`: the EngineFactory a group leader on this node builds its engine with (DP
    attention across nodes; runtime/engine_process.py)."""
    sizes = ParallelSizes.from_args(args)
    where = endpoint(args)
    try:
        wait_reachable(where, args.watchdog_timeout)
    except RendezvousError as e:
        print(f"dsaserve serve: error: {e}", file=sys.stderr, flush=True)
        return 1
    first = args.node_rank * sizes.ranks_per_node
    children = spawn_ranks(args, range(first, first + sizes.ranks_per_node), where,
                           factory=factory)  # fmt: skip
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(True))
    signal.signal(signal.SIGINT, lambda *_: stop.append(True))
    print(f"dsaserve node {args.node_rank}: ranks {first}..{first + sizes.ranks_per_node - 1} "
          f"joined {where}", flush=True)  # fmt: skip
    try:
        while not stop:
            codes = [child.exitcode for child in children]
            if any(code not in (None, 0) for code in codes) or all(c == 0 for c in codes):
                break
            time.sleep(0.2)
    finally:
        kill_all(children)
    failed = [c.exitcode for c in children if c.exitcode not in (0, None)]
    return 1 if failed and not stop else 0
