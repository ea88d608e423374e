"""Native CPU decode under tensor parallel: `--tp 2 --threads 1` against `--tp 1 --threads 2`.

    python bench/tp_native.py [--models embedded,scale] [--repeats 2] [--tokens 48]

Both layouts use the machine's two cores: one rank on two threads, or two ranks on one each,
every rank running its shard of the step on the native layers (kernels/cpu_decode.cpp), the
all-reduces and the vocab-parallel parts over shared memory inside the call. `tp2 layered` is the
same two ranks with `--disable-native-decode` (the torch layers every layout ran before), `tp2
ep2 t1` the ranks with whole experts each (`--ep 2`). Each
layout is an offline `LLM` (the ranks `dsaserve serve --tp` starts), the layouts alternating
within each repeat. Models: the embedded one, and bench/cpu_scale.py's 12-layer GLM-5.3-shape
bf16 checkpoint (2.86 GB, beyond the cache; built by bench/resident_memory.py's `checkpoints`),
or (`scale-fp8`) its block-FP8 copy.

Rates leave prefill out: the prompts (`--prompt-len` tokens) are prefilled once into the radix
cache, then a run of 1 + N new tokens minus a run of 1 token over the same cached prompts (the
median of `--trials` such pairs), at batch 1 and at 8 requests at once. Prints a table, writes
JSON (bench/results/tp_native.json).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.pop("OMP_NUM_THREADS", None)  # --threads decides

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from resident_memory import checkpoints  # noqa: E402

from dsaserve import LLM, SamplingParams  # noqa: E402
from dsaserve.assets import default_model_path  # noqa: E402

LAYOUTS = {
    "tp1 t2": dict(tp_size=1, threads=2),
    "tp2 t1": dict(tp_size=2, threads=1),
    "tp2 ep2 t1": dict(tp_size=2, ep_size=2, threads=1),
    "tp2 layered": dict(tp_size=2, threads=1, disable_native_decode=True),
}
CACHE = Path.home() / ".cache" / "dsaserve" / "bench"


def model_path(name: str) -> Path:
    """embedded; scale (bf16) or scale-fp8 (its block-FP8 copy, kept FP8 on every rank)."""
    if name == "embedded":
        return Path(default_model_path())
    return checkpoints(CACHE, 12)["block-FP8" if name == "scale-fp8" else "bf16"]


def rate(llm: LLM, rows: int, args: argparse.Namespace, rng: torch.Generator) -> float:
    """Decode tok/s of `rows` requests at once: (1 + N tokens) - (1 token), both over the same
    prompts, prefilled before into the radix cache."""
    vocab = llm.engine.model_config.vocab_size
    prompts = [torch.randint(10, vocab - 10, (args.prompt_len,), generator=rng).tolist()
               for _ in range(rows)]  # fmt: skip

    def seconds(tokens: int) -> float:
        params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - start

    seconds(1)  # the prompts into the radix cache
    rates = []
    for _ in range(args.trials):
        one, more = seconds(1), seconds(1 + args.tokens)
        rates.append(rows * args.tokens / (more - one))
    return statistics.median(rates)


def measure(path: Path, layout: str, args: argparse.Namespace, seed: int) -> dict:
    rng = torch.Generator().manual_seed(seed)
    with LLM(str(path), **LAYOUTS[layout], max_running_requests=8,
             max_total_tokens=32 * (args.prompt_len + args.tokens + 64)) as llm:  # fmt: skip
        llm.generate([[11, 12, 13]], SamplingParams(max_tokens=4), use_tqdm=False)  # warm
        paths = llm.engine.stats()["rank_decode_paths"]
        return {"batch1": rate(llm, 1, args, rng), "conc8": rate(llm, 8, args, rng),
                "paths": paths}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="embedded,scale")
    parser.add_argument("--layouts", default="tp1 t2,tp2 t1,tp2 layered")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--json", default=str(ROOT / "bench" / "results" / "tp_native.json"))
    args = parser.parse_args()
    rows = []
    for model in args.models.split(","):
        path = model_path(model)
        for repeat in range(args.repeats):
            for layout in args.layouts.split(","):
                got = measure(path, layout, args, seed=repeat)
                rows.append({"model": model, "repeat": repeat + 1, "layout": layout, **got})
                print(f"{model:9} run {repeat + 1} {layout:12} batch 1 {got['batch1']:7.1f} "
                      f"tok/s   8 concurrent {got['conc8']:7.1f} tok/s   {got['paths']}",
                      flush=True)  # fmt: skip
    print("\n| model | run | layout | batch 1 tok/s | vs tp1 t2 | 8 concurrent tok/s | vs tp1 t2 |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        base = next(r for r in rows if r["model"] == row["model"] and r["repeat"] == row["repeat"]
                    and r["layout"] == "tp1 t2")  # fmt: skip
        print(f"| {row['model']} | {row['repeat']} | {row['layout']} | {row['batch1']:.1f} | "
              f"{row['batch1'] / base['batch1']:.2f}x | {row['conc8']:.1f} | "
              f"{row['conc8'] / base['conc8']:.2f}x |")  # fmt: skip
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
