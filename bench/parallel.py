"""Tensor parallel on CPU: output tok/s of `--tp 1` vs `--tp 2` at concurrency 32.

    python bench/parallel.py [--concurrency 32] [--input-len 64] [--output-len 32]

One torch thread per rank (OMP_NUM_THREADS=1), so tp 2 uses two cores where tp 1 uses one:
the speed-up is what splitting the weights and the work across ranks buys, less what the
collectives cost. Models: a random GLM-style checkpoint of >= 100M parameters (fp32) and the
embedded model. Per run it reports rank 0's time inside the model's collectives (all-reduce,
all-gather) and in the rank sync (op headers and batch broadcasts), per engine step. `tp 2
gloo` is the same layout with `--disable-custom-all-reduce` (every collective on gloo's TCP
transport instead of the shared-memory one), so the table shows what each part buys.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from tiny_models import make_checkpoint  # noqa: E402

from dsaserve import LLM, SamplingParams  # noqa: E402
from dsaserve.assets import default_model_path  # noqa: E402

LARGE = dict(
    vocab_size=16384, hidden_size=1024, intermediate_size=2816, moe_intermediate_size=512,
    num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=16, q_lora_rank=512,
    kv_lora_rank=256, qk_rope_head_dim=32, qk_nope_head_dim=64, v_head_dim=64,
    n_routed_experts=32, num_experts_per_tok=4, n_shared_experts=1, first_k_dense_replace=1,
    index_topk=256, index_n_heads=16, index_head_dim=64, max_position_embeddings=4096,
)  # fmt: skip


def large_checkpoint(folder: Path) -> Path:
    if not (folder / "config.json").is_file():
        torch.manual_seed(0)
        make_checkpoint(folder, "glm", **LARGE)
    return folder


def params_of(folder: Path) -> int:
    from safetensors import safe_open

    total = 0
    for file in folder.glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            for name in f.keys():
                shape = f.get_slice(name).get_shape()
                total += int(torch.tensor(shape).prod()) if shape else 1
    return total


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (Linux /proc), so the split shows under load too."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run(model: Path, tp: int, args: argparse.Namespace, gloo: bool = False) -> dict:
    torch.manual_seed(1)
    llm = LLM(str(model), tp_size=tp, max_running_requests=args.concurrency,
              max_total_tokens=args.concurrency * (args.input_len + args.output_len) * 2,
              page_size=16, disable_custom_all_reduce=gloo)  # fmt: skip
    vocab = llm.engine.model_config.vocab_size
    prompts = [torch.randint(1, vocab, (args.input_len,)).tolist() for _ in range(args.concurrency)]
    params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
    parallel, runner = llm.engine.parallel, getattr(llm.engine.model, "runner", None)
    comm0, sync0 = parallel.comm_seconds, runner.sync_seconds if runner else 0.0
    steps0 = runner.rounds if runner else 0
    pids = [os.getpid()] + [c.pid for c in (llm.ranks.children if llm.ranks else [])]
    cpu0 = [cpu_seconds(pid) for pid in pids]
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    cpu = [round(cpu_seconds(pid) - c, 2) for pid, c in zip(pids, cpu0)]
    tokens = sum(len(o.token_ids) for o in outs)
    steps = args.output_len  # one decode step per output token (prefill: the first)
    record = {
        "tp": tp, "collectives": "none" if tp == 1 else ("gloo" if gloo else "shared memory"),
        "output_tokens": tokens, "seconds": round(wall, 3),
        "output_tok_s": round(tokens / wall, 1), "ms_per_step": round(1000 * wall / steps, 2),
        "collective_ms_per_step": round(1000 * (parallel.comm_seconds - comm0) / steps, 2),
        "sync_ms_per_step": round(1000 * ((runner.sync_seconds if runner else 0) - sync0)
                                  / steps, 2),
        "rounds_per_step": round(((runner.rounds if runner else 0) - steps0) / steps, 1),
        "cpu_seconds_per_rank": cpu, "load_average": round(os.getloadavg()[0], 1),
    }  # fmt: skip
    llm.close()
    return record


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--cache", default="/tmp/dsaserve-bench-parallel")
    ap.add_argument("--json", default="bench/results/parallel.json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    models = {"random-large": large_checkpoint(Path(args.cache) / "large"),
              "embedded": default_model_path()}  # fmt: skip
    results = []
    for name, folder in models.items():
        runs = []
        for tp, gloo in ((1, False), (2, False), (2, True)):
            runs.append(run(folder, tp, args, gloo))
            runs[-1]["speedup"] = round(runs[-1]["output_tok_s"] / runs[0]["output_tok_s"], 2)
            print(name, runs[-1], flush=True)
        results.append({"model": name, "params": params_of(folder), "runs": runs,
                        "speedup_tp2": runs[1]["speedup"]})  # fmt: skip
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    print(f"concurrency {args.concurrency}, input {args.input_len}, output {args.output_len}, "
          f"one torch thread per rank, {when}")  # fmt: skip
    print(
        f"{'model':14} {'params':>8} {'tp':>8} {'tok/s':>8} {'ms/step':>8} "
        f"{'collective ms':>13} {'sync ms':>8} {'CPU s per rank':>16} {'speed-up':>8}"
    )
    for r in results:
        for run_ in r["runs"]:
            up = f"{run_['speedup']:.2f}x" if run_["tp"] == 2 else ""
            cpu = "/".join(f"{c:.1f}" for c in run_["cpu_seconds_per_rank"])
            gloo = run_["collectives"] == "gloo" and run_["tp"] > 1
            tp = f"{run_['tp']}" + (" gloo" if gloo else "")
            print(
                f"{r['model']:14} {r['params'] / 1e6:7.1f}M {tp:>8} "
                f"{run_['output_tok_s']:>8} {run_['ms_per_step']:>8} "
                f"{run_['collective_ms_per_step']:>13} {run_['sync_ms_per_step']:>8} "
                f"{cpu:>16} {up:>8}"
            )
    record = {
        "concurrency": args.concurrency,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "threads_per_rank": 1,
        "measured_at": when,
        "results": results,
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
