"""Where a batch-1 decode step's time goes: per-step wall time split into the model forward and
the rest of the engine step, and the forward's op count and top ops: the layered model, the fused
path in Python, and its native form (kernels/cpu_decode.cpp; its ATen calls are the only ops left).

    python bench/decode_profile.py [--model-path DIR] [--prompt-len 512] [--steps 64] \
        [--threads 1] [--json bench/results/decode_profile.json]

Each mode decodes the same prompt greedily; the first pass warms up, the second is timed step by
step, the third runs under torch.profiler (its time is not reported, its op counts are).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from collections import Counter
from pathlib import Path

from torch.profiler import ProfilerActivity, profile

from dsaserve.args import ServerArgs
from dsaserve.assets import default_model_path
from dsaserve.engine.engine import Engine
from dsaserve.engine.io import GenerateRequest

MODES = {"layered": {"disable_fused_decode": True}, "fused": {"disable_native_decode": True},
         "native": {}, "fused+compile": {"enable_torch_compile": True}}  # fmt: skip


def decode(engine: Engine, prompt: list[int], steps: int, rid: str, forward_ms: list[float]):
    """Step times [ms] of the decode steps (after the first token) of one request."""
    sampling = {"max_tokens": steps + 1, "temperature": 0.0, "ignore_eos": True}
    engine.add_request(GenerateRequest(rid=rid, input_ids=prompt, sampling=sampling, stream=False))
    req = engine.reqs[rid]
    while not req.output_ids:
        engine.step()
    times = []
    while engine.has_work():
        start = time.perf_counter()
        engine.step()
        times.append(1e3 * (time.perf_counter() - start))
    return times


def timed_runner(engine: Engine, forward_ms: list[float]) -> None:
    original = engine.runner.forward

    def forward(*args, **kwargs):
        start = time.perf_counter()
        out = original(*args, **kwargs)
        forward_ms.append(1e3 * (time.perf_counter() - start))
        return out

    engine.runner.forward = forward


def profile_mode(name: str, args: argparse.Namespace, prompt: list[int]) -> dict:
    server_args = ServerArgs(
        model_path=str(args.model_path),
        max_total_tokens=4 * len(prompt) + 1024,
        disable_radix_cache=True,
        threads=args.threads,
        **MODES[name],
    )
    engine = Engine(server_args, show_progress=False)
    forward_ms: list[float] = []
    decode(engine, prompt, args.steps, f"{name}-warm", forward_ms)
    timed_runner(engine, forward_ms)
    steps = decode(engine, prompt, args.steps, f"{name}-timed", forward_ms)
    forwards = forward_ms[-len(steps) :]
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        decode(engine, prompt, args.steps, f"{name}-prof", [])
    counts = Counter()
    for event in prof.key_averages():
        if event.key.startswith("aten::"):
            counts[event.key] += event.count
    ops = sum(counts.values()) / (args.steps + 1)
    row = {"mode": name, "step_ms": statistics.median(steps),
           "forward_ms": statistics.median(forwards), "aten_ops_per_step": ops,
           "top_ops": counts.most_common(12)}  # fmt: skip
    row["engine_ms"] = row["step_ms"] - row["forward_ms"]
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-path", default=str(default_model_path()))
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--modes", default="layered,fused,native")
    p.add_argument("--json", default="bench/results/decode_profile.json")
    args = p.parse_args()
    vocab = json.loads((Path(args.model_path) / "config.json").read_text())["vocab_size"]
    rng = random.Random(0)
    prompt = [rng.randrange(32, vocab) for _ in range(args.prompt_len)]
    rows = [profile_mode(name, args, prompt) for name in args.modes.split(",")]
    print("| path | step ms | forward ms | rest of step ms | aten ops / step | decode tok/s |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['mode']} | {r['step_ms']:.2f} | {r['forward_ms']:.2f} | {r['engine_ms']:.2f} "
              f"| {r['aten_ops_per_step']:.0f} | {1e3 / r['step_ms']:.1f} |")  # fmt: skip
    for r in rows:
        print(r["mode"], "top ops per step:", ", ".join(f"{k[6:]} {v / (args.steps + 1):.0f}"
                                                        for k, v in r["top_ops"]))  # fmt: skip
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    result = {"args": vars(args), "load": list(os.getloadavg()), "rows": rows}
    Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
