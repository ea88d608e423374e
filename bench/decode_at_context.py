"""Batch-1 decode step time against context length, without the prefill: the engine adopts L
tokens of random KV (the path a PD decode server takes for KV computed elsewhere,
`Engine.adopt`), then each `Engine.step()` is timed. A 60k prompt's 450 s prefill is skipped,
and the ITL is read step by step (median of --steps) instead of as the difference of two
generate calls, which is what makes `bench/long_context.py`'s ITL noisy.

    python bench/decode_at_context.py [--lengths 1024,8192,32768,61440] [--steps 64]
        [--modes native,layered] [--rounds 2] [--json bench/results/decode_at_context.json]

One torch thread (OMP_NUM_THREADS=1), the embedded model, fp32. `native` is the default decode
path (kernels/cpu_decode.cpp); `layered` is `--disable-fused-decode`. Each (mode, length) runs in
its own process; --rounds repeats the sweep with the modes interleaved, and every run is
reported. The KV is random (index keys ~ N(0, 1)), so the top-k picks scattered entries: the
attention reads as much as with real text, and the scan of every key is the same work.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

MODES = {"native": {}, "layered": {"disable_fused_decode": True}}


def one(mode: str, length: int, steps: int) -> dict:
    from dsaserve import LLM
    from dsaserve.assets import default_model_path
    from dsaserve.engine.messages import GenerateRequest

    torch.set_num_threads(1)
    llm = LLM(str(default_model_path()), page_size=64, max_total_tokens=length + steps + 256,
              context_length=65536, **MODES[mode])  # fmt: skip
    engine, gen = llm.engine, torch.Generator().manual_seed(length)
    prompt = torch.randint(1, engine.model_config.vocab_size, (length,), generator=gen).tolist()
    sampling = {"max_tokens": steps + 1, "temperature": 0.0, "ignore_eos": True}
    req = engine.make_req(GenerateRequest(rid="probe", input_ids=prompt, sampling=sampling))
    pool = engine.pool
    pages = pool.pages.alloc(-(-length // pool.page_size))
    slots = pool.slots(pages, 0, length)
    for cache in (pool.kv_cache, pool.index_cache):  # [layers, slots, dim]
        cache[:, slots] = torch.randn(cache.shape[0], length, cache.shape[2], generator=gen)
    engine.adopt(req, pages, 5, None)
    times = []
    while engine.has_work():
        start = time.perf_counter()
        engine.step()
        times.append(1000 * (time.perf_counter() - start))
    llm.close()
    return {"mode": mode, "context": length, "steps": len(times),
            "median_ms": round(statistics.median(times), 2), "min_ms": round(min(times), 2),
            "load_average": os.getloadavg()[0]}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--lengths", default="1024,8192,32768,61440")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--modes", default="native,layered")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", default="bench/results/decode_at_context.json")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # "mode,length": run one in this process
    args = ap.parse_args()
    if args.one:
        mode, length = args.one.split(",")
        print(json.dumps(one(mode, int(length), args.steps)), flush=True)
        return
    runs = []
    for round_ in range(args.rounds):
        for length in map(int, args.lengths.split(",")):
            for mode in args.modes.split(","):  # interleaved: the machine is shared and noisy
                command = [sys.executable, __file__, "--one", f"{mode},{length}",
                           "--steps", str(args.steps)]  # fmt: skip
                out = subprocess.run(command, check=True, capture_output=True, text=True)
                runs.append({"round": round_, **json.loads(out.stdout.strip().splitlines()[-1])})
                print(runs[-1], flush=True)
    _print_table(runs)
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {"model": "embedded", "threads": 1, "runs": runs}
    path.write_text(json.dumps(record, indent=2) + "\n")


def _print_table(runs: list[dict]) -> None:
    shortest = {(r["mode"], r["round"]): r["median_ms"] for r in runs
                if r["context"] == min(x["context"] for x in runs)}  # fmt: skip
    print(f"{'mode':>8} {'round':>5} {'context':>8} {'median ms':>9} {'min ms':>7} "
          f"{'x shortest':>10} {'load':>5}")  # fmt: skip
    for r in sorted(runs, key=lambda r: (r["mode"], r["round"], r["context"])):
        ratio = r["median_ms"] / shortest[(r["mode"], r["round"])]
        print(f"{r['mode']:>8} {r['round']:>5} {r['context']:>8} {r['median_ms']:>9} "
              f"{r['min_ms']:>7} {ratio:>10.2f} {r['load_average']:>5.1f}")  # fmt: skip


if __name__ == "__main__":
    main()
