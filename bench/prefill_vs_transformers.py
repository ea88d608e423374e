"""Prefill throughput: dsaserve against transformers' forward on the same checkpoint, by length.

    python bench/prefill_vs_transformers.py [--lengths 1024,2048,4096] [--ours 32768]
        [--model-path DIR] [--json bench/results/prefill_vs_transformers.json]

Both in fp32 on one torch thread, each (side, length) in its own process (so peak RSS is that
run's). transformers: one `model(input_ids)` forward of a random prompt (no cache), last-token
logits. dsaserve: the offline `LLM`, a greedy max_tokens-1 request of the same prompt, the whole
prompt in one prefill forward (`chunked_prefill_size` = the length), its TTFT. Both are checked
to pick the same first token.

transformers' DSA reference materialises the indexer's per-head scores [1, S, heads, S] and the
attention's [1, heads, S, S] weights and masks in fp32, so its memory grows with S^2: the script
reports the largest tensor of one layer at each length and at `--ours` (where only dsaserve runs
if transformers' forward would not fit in this machine's memory).
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
from flops import prefill_flops  # noqa: E402

MIB = 1 << 20


def _prompt(length: int, vocab: int) -> list[int]:
    generator = torch.Generator().manual_seed(length)
    return torch.randint(1, vocab, (length,), generator=generator).tolist()


def dense_bytes(config: dict, length: int) -> dict[str, int]:
    """transformers' quadratic fp32 tensors in one layer's forward at `length` tokens."""
    square = 4 * length * length
    return {"indexer_head_scores": square * config["index_n_heads"],
            "attention_weights": square * config["num_attention_heads"],
            "index_scores_or_mask": square}  # fmt: skip


def run_transformers(folder: Path, length: int) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = torch.tensor([_prompt(length, model.config.vocab_size)])
    with torch.no_grad():
        model(ids[:, :8])  # warm-up
        start = time.perf_counter()
        logits = model(ids, logits_to_keep=1).logits[0, -1]
        seconds = time.perf_counter() - start
    return {"seconds": seconds, "first_token": int(logits.argmax())}


def run_ours(folder: Path, length: int) -> dict:
    from dsaserve import LLM, SamplingParams

    llm = LLM(str(folder), chunked_prefill_size=length, max_total_tokens=length + 512,
              context_length=max(length + 64, 4096), disable_radix_cache=True)  # fmt: skip
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    llm.generate([[5, 6, 7]], params, use_tqdm=False)  # warm-up
    prompt = _prompt(length, llm.engine.model_config.vocab_size)
    start = time.perf_counter()
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    seconds = time.perf_counter() - start
    llm.close()
    return {"seconds": seconds, "first_token": out.token_ids[0]}


def one(side: str, folder: Path, length: int) -> dict:
    torch.set_num_threads(1)
    result = (run_ours if side == "dsaserve" else run_transformers)(folder, length)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    flops = prefill_flops(folder, length)
    return {"side": side, "prompt_tokens": length, "seconds": round(result["seconds"], 3),
            "tok_s": round(length / result["seconds"], 1),
            "gflop_s": round(flops / result["seconds"] / 1e9, 1),
            "first_token": result["first_token"], "peak_rss_mib": round(rss / MIB)}  # fmt: skip


def main() -> None:
    from dsaserve.assets import default_model_path

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="1024,2048,4096")
    ap.add_argument("--ours", default="32768", help="lengths only dsaserve runs")
    ap.add_argument("--model-path", default=str(default_model_path()))
    ap.add_argument("--json", default="bench/results/prefill_vs_transformers.json")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # "side,length"
    args = ap.parse_args()
    folder = Path(args.model_path)
    if args.one:
        side, length = args.one.split(",")
        print(json.dumps(one(side, folder, int(length))), flush=True)
        return
    config = json.loads((folder / "config.json").read_text())
    sides = ("transformers", "dsaserve")
    jobs = [(side, int(n)) for n in args.lengths.split(",") for side in sides]
    jobs += [("dsaserve", int(n)) for n in args.ours.split(",") if n]
    runs = []
    for side, length in jobs:
        out = subprocess.run([sys.executable, __file__, "--one", f"{side},{length}",
                              "--model-path", str(folder)],
                             check=True, capture_output=True, text=True)  # fmt: skip
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(runs[-1], flush=True)
    lengths = sorted({r["prompt_tokens"] for r in runs})
    dense = {n: dense_bytes(config, n) for n in lengths}
    print(f"{'tokens':>7} {'side':>12} {'s':>8} {'tok/s':>8} {'GFLOP/s':>8} {'RSS MiB':>8} "
          f"{'HF largest layer tensor MiB':>27}")  # fmt: skip
    for r in runs:
        largest = max(dense[r["prompt_tokens"]].values()) / MIB
        print(f"{r['prompt_tokens']:>7} {r['side']:>12} {r['seconds']:>8} {r['tok_s']:>8} "
              f"{r['gflop_s']:>8} {r['peak_rss_mib']:>8} {largest:>27,.0f}")  # fmt: skip
    record = {"model": folder.name, "threads": 1, "runs": runs,
              "transformers_dense_bytes_per_layer": dense,
              "machine_memory_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
              "load_average": os.getloadavg()}  # fmt: skip
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
