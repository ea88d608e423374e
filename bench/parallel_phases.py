"""Where a `--tp N` run's time goes: prefill vs decode steps, rank 0's wall and each rank's CPU.

    OMP_NUM_THREADS=1 python bench/parallel_phases.py --tp 2 [--ep 2] [--gloo]

The workload and checkpoint of bench/parallel.py (32 requests, 64-token prompts, 32 greedy
tokens, the 213M random GLM checkpoint). Every engine step is timed on rank 0 and each rank's
user+system CPU time (from /proc) is read around it, so a rank that waits shows as wall time
its CPU did not use; plus rank 0's time in the model's collectives and in the rank sync.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from parallel import cpu_seconds, large_checkpoint  # noqa: E402

from dsaserve import LLM, SamplingParams  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--gloo", action="store_true", help="--disable-custom-all-reduce")
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--cache", default="/tmp/dsaserve-bench-parallel")
    args = ap.parse_args()
    torch.set_num_threads(1)
    folder = large_checkpoint(Path(args.cache) / "large")
    torch.manual_seed(1)
    llm = LLM(str(folder), tp_size=args.tp, ep_size=args.ep, max_running_requests=32,
              max_total_tokens=32 * (64 + args.output_len) * 2, page_size=16,
              disable_custom_all_reduce=args.gloo)  # fmt: skip
    engine = llm.engine
    prompts = [torch.randint(1, engine.model_config.vocab_size, (64,)).tolist() for _ in range(32)]
    llm.generate(prompts[:2], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
    pids = [os.getpid()] + [c.pid for c in (llm.ranks.children if llm.ranks else [])]
    phases = {"prefill": [0, 0.0, [0.0] * len(pids)], "decode": [0, 0.0, [0.0] * len(pids)]}
    step, forward, kind = engine.step, engine.runner.forward, ["prefill"]

    def classified_forward(scheduled, all_rows=False):
        one = all(e - s == 1 for s, e in zip(scheduled.starts, scheduled.ends))
        kind[0] = "decode" if one else "prefill"
        return forward(scheduled, all_rows)

    def timed_step():
        cpu0, start = [cpu_seconds(p) for p in pids], time.perf_counter()
        out = step()
        phase = phases[kind[0]]
        phase[0] += 1
        phase[1] += time.perf_counter() - start
        phase[2] = [c + cpu_seconds(p) - c0 for c, p, c0 in zip(phase[2], pids, cpu0)]
        return out

    engine.runner.forward = classified_forward
    engine.step = timed_step
    comm0 = engine.parallel.comm_seconds
    rounds = getattr(engine.model, "runner", None)
    sync0 = rounds.sync_seconds if rounds else 0.0
    start = time.perf_counter()
    params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    comm = engine.parallel.comm_seconds - comm0
    sync = (rounds.sync_seconds - sync0) if rounds else 0.0
    print(f"tp {args.tp} ep {args.ep}{' gloo' if args.gloo else ''}: wall {wall:.2f} s, "
          f"rank 0 in collectives {comm:.2f} s, in sync {sync:.2f} s, "
          f"load {os.getloadavg()[0]:.1f}")  # fmt: skip
    for name, (steps, seconds, cpu) in phases.items():
        print(f"  {name}: {steps} steps, wall {seconds:.2f} s, CPU s per rank "
              f"{' / '.join(f'{c:.2f}' for c in cpu)}")  # fmt: skip
    llm.close()


if __name__ == "__main__":
    main()
