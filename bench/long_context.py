"""Long context on the embedded model: TTFT and decode ITL against prompt length, cp 1 vs cp 2.

    python bench/long_context.py [--lengths 1024,8192,32768,61440] [--cps 1,2] [--decode 16]
        [--chunk 2048] [--merge] [--plot docs/images/long_context.svg]

cp 1 is the single-process engine; cp 2 is `--tp 2 --attn-cp-size 2 --enable-prefill-cp
--cp-strategy interleave` (two ranks on gloo). One torch thread per rank (OMP_NUM_THREADS=1), so
cp 2 uses two cores where cp 1 uses one. Each (cp, length) runs in its own process, so peak RSS
is per run: rank 0's (the engine) and the largest other rank's.

TTFT: wall time of a greedy request with max_tokens 1 on a fresh random prompt (prefill in
chunks of --chunk, the first token). ITL: the same prompt again (a radix hit: only its last
page is recomputed) with max_tokens 1 + D; (that time - the hit's own one-token time) / D.
Each run also records the prefill's FLOPs (bench/flops.py: 2 x active parameters per token plus
the attention and the indexer's causal scan) over its TTFT, and the machine's fp32 matmul peak
at one thread. `--merge` adds the runs to the JSON already there (one (length, cp) per
invocation, so a long sweep can be split into short benchmark slots); `--plot` draws TTFT and
ITL against the prompt length from the JSON (bench/long_context_plot.py).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
from flops import matmul_peak, prefill_flops  # noqa: E402
from long_context_plot import write_plot  # noqa: E402


def one(cp: int, length: int, decode: int, chunk: int, layered: bool = False) -> dict:
    from dsaserve import LLM, SamplingParams
    from dsaserve.assets import default_model_path

    torch.set_num_threads(1)
    flags = dict(tp_size=2, attn_cp_size=2, enable_prefill_cp=True, cp_strategy="interleave")
    llm = LLM(str(default_model_path()), page_size=64, chunked_prefill_size=chunk,
              max_total_tokens=length + decode + 256, context_length=65536,
              disable_fused_decode=layered, **(flags if cp == 2 else {}))  # fmt: skip
    vocab = llm.engine.model_config.vocab_size
    gen = torch.Generator().manual_seed(length)
    prompt = torch.randint(1, vocab, (length,), generator=gen).tolist()
    first = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    llm.generate([[5, 6, 7]], first, use_tqdm=False)  # warm-up
    start = time.perf_counter()
    llm.generate([prompt], first, use_tqdm=False)
    ttft = time.perf_counter() - start
    start = time.perf_counter()
    llm.generate([prompt], first, use_tqdm=False)
    hit = time.perf_counter() - start
    params = SamplingParams(max_tokens=1 + decode, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    llm.generate([prompt], params, use_tqdm=False)
    itl = (time.perf_counter() - start - hit) / decode
    llm.close()
    flops = prefill_flops(default_model_path(), length)
    kib = 1024  # ru_maxrss is in KiB on Linux
    return {"cp": cp, "prompt_tokens": length, "decode_steps": decode, "ttft_s": round(ttft, 3),
            "prefill_gflop": round(flops / 1e9, 1),
            "prefill_gflop_s": round(flops / ttft / 1e9, 1),
            "matmul_peak_gflop_s_1_thread": round(matmul_peak(1).best / 1e9, 1),
            "load_average": os.getloadavg()[0],
            "itl_ms": round(1000 * itl, 2), "prefill_tok_s": round(length / ttft, 1),
            "peak_rss_mib_rank0": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / kib),
            "peak_rss_mib_other_ranks": round(
                resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / kib)}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--lengths", default="1024,8192,32768,61440")
    ap.add_argument("--cps", default="1,2")
    ap.add_argument("--decode", type=int, default=16)
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--json", default="bench/results/long_context.json")
    ap.add_argument("--merge", action="store_true", help="keep the JSON's other runs")
    ap.add_argument("--disable-fused-decode", action="store_true",
                    help="decode on the layered path (cp 2 always is)")  # fmt: skip
    ap.add_argument("--plot", help="write an SVG of TTFT and ITL against the prompt length")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # "cp,length": run one in this process
    args = ap.parse_args()
    if args.one:
        cp, length = map(int, args.one.split(","))
        run = one(cp, length, args.decode, args.chunk, args.disable_fused_decode)
        print(json.dumps(run), flush=True)
        return
    path = Path(args.json)
    old = json.loads(path.read_text())["runs"] if args.merge and path.exists() else []
    runs = []
    for length in map(int, args.lengths.split(",")) if args.lengths else []:
        for cp in map(int, args.cps.split(",")):
            layered = ["--disable-fused-decode"] if args.disable_fused_decode else []
            command = [sys.executable, __file__, "--one", f"{cp},{length}", "--decode",
                       str(args.decode), "--chunk", str(args.chunk), *layered]  # fmt: skip
            out = subprocess.run(command, check=True, capture_output=True, text=True)
            runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(runs[-1], flush=True)
    done = {(r["cp"], r["prompt_tokens"]) for r in runs}
    runs = sorted([r for r in old if (r["cp"], r["prompt_tokens"]) not in done] + runs,
                  key=lambda r: (r["prompt_tokens"], r["cp"]))  # fmt: skip
    _print_table(runs, args)
    record = {"model": "embedded", "chunk": args.chunk, "threads_per_rank": 1,
              "runs": runs}  # each run says its decode_steps  # fmt: skip
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2) + "\n")
    if args.plot:
        write_plot(runs, Path(args.plot))


def _print_table(runs: list[dict], args: argparse.Namespace) -> None:
    print(f"embedded model, chunk {args.chunk}, one thread per rank")
    print(f"{'tokens':>7} {'cp':>3} {'TTFT s':>8} {'prefill tok/s':>13} {'GFLOP/s':>8} "
          f"{'ITL ms':>7} {'steps':>5} {'RSS MiB r0':>10} {'RSS MiB r1':>10}")  # fmt: skip
    for r in runs:
        print(f"{r['prompt_tokens']:>7} {r['cp']:>3} {r['ttft_s']:>8} {r['prefill_tok_s']:>13} "
              f"{r['prefill_gflop_s']:>8} {r['itl_ms']:>7} {r.get('decode_steps', 16):>5} "
              f"{r['peak_rss_mib_rank0']:>10} {r['peak_rss_mib_other_ranks']:>10}")  # fmt: skip


if __name__ == "__main__":
    main()
