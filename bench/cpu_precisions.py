"""Batch-1 CPU decode of one model in the precisions it ships: bf16, block FP8, NVFP4 (native path).

The checkpoints are bench/resident_memory.py's (GLM-5.3's shape at reduced width and depth,
cached; the FP8 one kept FP8, the NVFP4 one's routed experts kept 4-bit). Each run is a fresh
process: a 512-token prompt, then `--tokens` greedy decode steps; the decode rate is
(tokens - 1) / (time of the whole request - time of a 1-token request), so prefill is left out.
Runs alternate the checkpoints, `--repeats` times, at each `--threads`. The FP8 engine reads
about half the weight bytes a token of the bf16 one; this says what that buys.

    python bench/cpu_precisions.py [--layers 6] [--threads 1 2] [--repeats 2] [--tokens 48]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from resident_memory import checkpoints, model_arguments

ROOT = Path(__file__).resolve().parents[1]
MEASURE = """
import json, sys, time
from dsaserve import LLM, SamplingParams
folder, threads, tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
prompt = [(7 * i) % 300 + 20 for i in range(512)]
def timed(llm, n):
    start = time.perf_counter()
    llm.generate([prompt], SamplingParams(max_tokens=n, temperature=0, ignore_eos=True),
                 use_tqdm=False)
    return time.perf_counter() - start
with LLM(folder, max_total_tokens=4096, threads=threads) as llm:
    timed(llm, 2)  # warm: first calls, the native build's load
    one, whole = timed(llm, 1), timed(llm, tokens)
    print(json.dumps({"tok_s": (tokens - 1) / (whole - one),
                      "decode_path": llm.engine.stats()["decode_path"]}))
"""


def measure(folder: Path, threads: int, tokens: int) -> dict:
    out = subprocess.run([sys.executable, "-c", MEASURE, str(folder), str(threads), str(tokens)],
                         check=True, capture_output=True, text=True, cwd=ROOT)  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    model_arguments(parser, "cpu_precisions.json")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--tokens", type=int, default=48)
    args = parser.parse_args()
    folders = checkpoints(args.cache, args.layers)
    rows = []
    print("| checkpoint | threads | repeat | decode tok/s | decode path |")
    print("|---|---:|---:|---:|---|")
    for threads in args.threads:
        for repeat in range(args.repeats):
            for name, folder in folders.items():  # alternating
                row = {"checkpoint": name, "threads": threads, "repeat": repeat + 1,
                       **measure(folder, threads, args.tokens)}  # fmt: skip
                rows.append(row)
                print(f"| {name} | {threads} | {repeat + 1} | {row['tok_s']:.1f} | "
                      f"{row['decode_path']} |", flush=True)  # fmt: skip
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
