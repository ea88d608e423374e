"""`/health` and a short completion while bursts of `GET /api/plan/matrix` run (issue 32).

    python bench/planner_load.py --url before=http://127.0.0.1:30001 --url after=http://...:30002
        [--bursts 5] [--concurrency 64] [--out bench/results/planner_load.json]

Each burst sends `--concurrency` matrix calls at once (the same query: what a page full of
console tabs does) and, while they run, polls `/health` every 20 ms and times one 32-token
completion. Bursts alternate between the servers (interleaved, so both see the same machine
load). Prints, per server: `/health` p50 / p95 / max, the matrix calls' p50 / p95, and the
completion's median, in milliseconds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from pathlib import Path

import httpx


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def burst(url: str, concurrency: int) -> dict[str, list[float]]:
    matrix: list[float] = []
    health: list[float] = []
    completion: list[float] = []

    def call_matrix() -> None:
        start = time.perf_counter()
        httpx.get(url + "/api/plan/matrix", params={"speculative": "none"}, timeout=120)
        matrix.append(time.perf_counter() - start)

    def complete() -> None:
        body = {"prompt": "The weather today", "max_tokens": 32, "temperature": 0,
                "ignore_eos": True}  # fmt: skip
        start = time.perf_counter()
        httpx.post(url + "/v1/completions", json=body, timeout=120).raise_for_status()
        completion.append(time.perf_counter() - start)

    workers = [threading.Thread(target=call_matrix) for _ in range(concurrency)]
    workers.append(threading.Thread(target=complete))
    for worker in workers:
        worker.start()
    with httpx.Client(base_url=url, timeout=30) as client:
        while any(w.is_alive() for w in workers):
            start = time.perf_counter()
            client.get("/health")
            health.append(time.perf_counter() - start)
            time.sleep(0.02)
    for worker in workers:
        worker.join()
    return {"matrix": matrix, "health": health, "completion": completion}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", action="append", required=True, help="label=http://host:port")
    parser.add_argument("--bursts", type=int, default=5)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--out", default="bench/results/planner_load.json")
    args = parser.parse_args()
    servers = dict(item.split("=", 1) for item in args.url)
    runs: dict[str, dict[str, list[float]]] = {name: {} for name in servers}
    for _ in range(args.bursts):
        for name, url in servers.items():
            for key, values in burst(url, args.concurrency).items():
                runs[name].setdefault(key, []).extend(values)
    rows = {}
    print(f"{'server':10} {'health p50':>10} {'p95':>7} {'max':>7} {'matrix p50':>10} {'p95':>7} "
          f"{'completion':>10}   (ms)")  # fmt: skip
    for name, r in runs.items():
        ms = lambda v: round(1000 * v, 1)  # noqa: E731
        row = {"health_p50": ms(percentile(r["health"], 0.5)),
               "health_p95": ms(percentile(r["health"], 0.95)), "health_max": ms(max(r["health"])),
               "matrix_p50": ms(percentile(r["matrix"], 0.5)),
               "matrix_p95": ms(percentile(r["matrix"], 0.95)),
               "completion_median": ms(statistics.median(r["completion"]))}  # fmt: skip
        rows[name] = row
        widths = (10, 7, 7, 10, 7, 10)
        print(f"{name:10} " + " ".join(f"{v:>{w}}" for v, w in zip(row.values(), widths)))
    Path(args.out).write_text(json.dumps({"args": vars(args), "results": rows}, indent=2))


if __name__ == "__main__":
    main()
