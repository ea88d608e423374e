"""Who runs where: the processes of a dsaserve deployment, their start, watchdog and teardown.

- `preflight.py`: every flag checked once, before any process starts.
- `engine_process.py`: the engine process (ZMQ in, `step()`, ZMQ out) and what it drives.
- `ipc.py`: the typed messages and socket paths between the API process and engine processes.
- `ranks.py`: this node's rank processes (spawn, watch, stop); `rank_entry.py` is their `-m`.
- `follower.py`: what a spawned rank runs (the rank loop over its shard, or a DP group's engine).
- `node.py`: `dsaserve serve --node-rank N`: the ranks of another node.
- `omp.py`: `GOMP_SPINCOUNT` for every process that will import torch (set before it does).
"""
