"""A server process ends without its interpreter's last garbage collections.

Python, ending, collects every object still alive, then again as it empties each module. In a
process that imported torch and transformers that graph is millions of objects: ~1 s of CPU in
the engine process and ~1.2 s in the API process on a 2-core machine of ours, after everything
was stopped and closed (a `dsaserve serve` took 2.7 s from SIGTERM to its last process gone,
0.8 s without them). Nothing is left to release then: sockets, shared memory and files were
closed by the code that opened them, `atexit` handlers (and `weakref.finalize`) run before, and
the OS frees the rest. So the last `atexit` handler freezes what is alive and those collections
find nothing to do. Ranks end with `os._exit` already (runtime/rank_entry.py).
"""

from __future__ import annotations

import atexit
import gc


def skip_final_collection() -> None:
    """Call early in a process's entry point: `atexit` runs handlers last-registered first, so
    this one runs after the others."""
    atexit.register(gc.freeze)
