"""HiCache on the embedded model: TTFT of an evicted prefix, and a Claude-Code-like workload.

    python bench/hicache.py [--prefix-lens 8192,32768] [--threads N] [--skip-workload] [--tp N]

1. For each prefix length: a request `prefix + suffix` runs cold (recompute); then every
   device page is evicted (`cache.evict`, what the scheduler calls when it needs room: with
   HiCache the pages are demoted to host), and `prefix + other suffix` is timed with the prefix on
   host (host hit). A fresh engine on the same storage directory (a restart) times it again from
   storage (storage hit, wait_complete).
   TTFT = the wall time of a 1-token request (prefill of the suffix + loading the prefix).
   With `--tp N` the engine runs N ranks (this process is rank 0), each moving its own copy.
2. A Claude-Code-like workload: a fixed system + tools prefix, conversations taking turns round
   robin (each turn adds the previous reply and a new user message), more conversations than the
   device pool holds. Hit rate (cached / prompt tokens) and mean TTFT, hierarchy off vs on.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import tempfile
import time
from pathlib import Path

import torch

from dsaserve import LLM, SamplingParams
from dsaserve.engine.messages import GenerateRequest

PAGE = 64
SUFFIX = 64
FIRST = SamplingParams(max_tokens=1, temperature=0)


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(10, 1300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


_rids = itertools.count()


def timed(llm: LLM, prompt: list[int], params: SamplingParams) -> tuple[float, list[int], int]:
    """(TTFT in s, output tokens, cached tokens) of one request run alone, streamed."""
    rid = f"bench-{next(_rids)}"
    sampling = dataclasses.asdict(params)
    start, first, ids, cached = time.perf_counter(), None, [], 0
    llm.engine.add_request(GenerateRequest(rid=rid, input_ids=prompt, sampling=sampling))
    while llm.engine.has_work():
        for out in llm.engine.step():
            if out.token_ids and first is None:
                first = time.perf_counter() - start
            ids += out.token_ids
            cached = out.cached_tokens
    return first, ids, cached


def ttft(llm: LLM, prompt: list[int]) -> tuple[float, int]:
    first, _, cached = timed(llm, prompt, FIRST)
    return first, cached


def engine(pool: int, store: Path | None, **kw) -> LLM:
    flags = {"page_size": PAGE, "max_total_tokens": pool, "chunked_prefill_size": 8192}
    if store is not None:
        config = json.dumps({"file_path": str(store), "max_size_gb": 4})
        flags |= {"enable_hierarchical_cache": True, "hicache_storage_backend": "file",
                  "hicache_storage_backend_extra_config": config,
                  "hicache_storage_prefetch_policy": "wait_complete"}  # fmt: skip
    return LLM(None, **flags, **kw)


def evicted_prefix(prefix_len: int, store: Path, **kw) -> dict:
    prefix = tokens(prefix_len, 1)
    pool = prefix_len + 4 * PAGE + SUFFIX  # one request of this length, never two
    llm = engine(pool, store, **kw)
    recompute, _ = ttft(llm, prefix + tokens(SUFFIX, 2))
    llm.engine.cache.evict(llm.engine.pool.pages.num_pages)  # the whole device pool, to host
    assert llm.engine.stats()["kv_cached_tokens"] == 0
    host, host_cached = ttft(llm, prefix + tokens(SUFFIX, 4))
    stats = llm.engine.stats()
    llm.engine.cache.storage.drain()
    llm.close()  # with ranks: each drains its own storage writes before it exits
    restarted = engine(pool, store, **kw)
    storage, storage_cached = ttft(restarted, prefix + tokens(SUFFIX, 5))
    s2 = restarted.engine.stats()
    restarted.close()
    return {"prefix_len": prefix_len, "tp": kw.get("tp_size", 1), "recompute_s": recompute,
            "host_hit_s": host,
            "storage_hit_s": storage, "host_cached_tokens": host_cached,
            "storage_cached_tokens": storage_cached, "host_ratio": host / recompute,
            "storage_ratio": storage / recompute, "h2d_bytes": stats["hicache_h2d_bytes"],
            "h2d_s": stats["hicache_h2d_seconds"],
            "storage_load_bytes": s2["hicache_storage_load_bytes"],
            "storage_load_s": s2["hicache_storage_load_seconds"]}  # fmt: skip


def workload(store: Path | None, convs: int, turns: int, prefix_len: int, turn_len: int) -> dict:
    system = tokens(prefix_len, 10)
    pool = prefix_len + turns * (turn_len + 16) + 4 * PAGE  # about one conversation
    llm = engine(pool, store)
    histories = [list(system) for _ in range(convs)]
    times, prompt_tokens, cached = [], 0, 0
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    for turn in range(turns):
        for c in range(convs):
            histories[c] += tokens(turn_len, 100 + 17 * c + turn)
            first, ids, hit = timed(llm, histories[c], params)
            times.append(first)
            prompt_tokens += len(histories[c])
            cached += hit
            histories[c] += ids
    if store is not None:
        llm.engine.cache.storage.drain()
    return {"hierarchy": store is not None, "requests": len(times), "pool_tokens": pool,
            "hit_rate": cached / prompt_tokens, "mean_ttft_s": sum(times) / len(times),
            "later_turns_mean_ttft_s": sum(times[convs:]) / max(len(times) - convs, 1)}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--prefix-lens", default="8192")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--skip-workload", action="store_true")
    ap.add_argument("--convs", type=int, default=4)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--tp", type=int, default=1, help="ranks (the evicted-prefix rows only)")
    ap.add_argument("--json", default="bench/results/hicache.json")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    results: dict = {"threads": torch.get_num_threads(), "evicted_prefix": [], "workload": []}
    for n in [int(x) for x in args.prefix_lens.split(",")]:
        with tempfile.TemporaryDirectory() as store:
            row = evicted_prefix(n, Path(store), tp_size=args.tp)
        results["evicted_prefix"].append(row)
        line = (f"tp {args.tp} prefix {n:>6}: recompute {row['recompute_s']:.2f} s | host hit "
                f"{row['host_hit_s']:.3f} s ({row['host_ratio']:.3f}x) | storage hit (restart) "
                f"{row['storage_hit_s']:.3f} s ({row['storage_ratio']:.3f}x)")  # fmt: skip
        print(line, flush=True)
    if not args.skip_workload:
        for on in (False, True):
            with tempfile.TemporaryDirectory() as store:
                row = workload(Path(store) if on else None, args.convs, args.turns, 2048, 512)
            results["workload"].append(row)
            print(f"workload hierarchy {'on ' if on else 'off'}: hit rate {row['hit_rate']:.3f}, "
                  f"mean TTFT {row['mean_ttft_s']:.3f} s "
                  f"(turns 2+: {row['later_turns_mean_ttft_s']:.3f} s)", flush=True)  # fmt: skip
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(results, indent=2))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
