"""Where a batch-1 decode step's time goes, and how far it is from its memory floor: per-step wall
time split into the model forward and the rest of the engine step, the forward's op count and top
ops (the layered model, the fused path in Python, its native form in kernels/cpu_decode.cpp), and
the bytes a step reads (weights + KV entries + index keys) over the step time, against this
machine's streaming read bandwidth measured in the same run.

    python bench/decode_profile.py [--model-path DIR] [--prompt-len 512] [--steps 64] \
        [--threads 1] [--kv-cache-dtype auto] [--json bench/results/decode_profile.json]

Each mode decodes the same prompt greedily; the first pass warms up, the second is timed step by
step, the third runs under torch.profiler (its time is not reported, its op counts are). The
bandwidth is the best of several passes of `torch.sum` over a 512 MiB buffer on the same number
of threads, taken before and after the modes.
"""

# ruff: noqa: E402 (torch is imported after GOMP_SPINCOUNT is set)
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from collections import Counter
from contextlib import nullcontext
from pathlib import Path

from dsaserve.runtime.omp import limit_omp_spinning

limit_omp_spinning()  # before torch is imported, as the server's engine processes (runtime/omp.py)

import torch
from step_bytes import step_bytes  # (bench/ is the script's folder)
from torch.profiler import ProfilerActivity, profile

from dsaserve.args import ServerArgs
from dsaserve.assets import default_model_path
from dsaserve.engine.engine import Engine
from dsaserve.engine.messages import GenerateRequest

MODES = {"layered": {"disable_fused_decode": True}, "fused": {"disable_native_decode": True},
         "native": {}, "fused+compile": {"enable_torch_compile": True}}  # fmt: skip


def decode(engine: Engine, prompt: list[int], steps: int, rid: str, watch=nullcontext):
    """Step times [ms] of the decode steps (after the first token) of one request; `watch()`
    is entered around those steps only (the profiler: a 16k prefill under it fills the RAM)."""
    sampling = {"max_tokens": steps + 1, "temperature": 0.0, "ignore_eos": True}
    engine.add_request(GenerateRequest(rid=rid, input_ids=prompt, sampling=sampling, stream=False))
    req = engine.reqs[rid]
    while not req.output_ids:
        engine.step()
    times = []
    with watch():
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


def stream_bandwidth(threads: int, mib: int = 512, passes: int = 7) -> float:
    """GB/s of the best pass of a sum over `mib` MiB of fp32 (a streaming read) on `threads`."""
    torch.set_num_threads(threads)
    data = torch.ones(mib * (1 << 20) // 4)
    best = float("inf")
    for _ in range(passes):
        start = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - start)
    return data.numel() * 4 / best / 1e9


def profile_mode(name: str, args: argparse.Namespace, prompt: list[int]) -> dict:
    server_args = ServerArgs(
        model_path=str(args.model_path),
        max_total_tokens=4 * len(prompt) + 1024,
        disable_radix_cache=True,
        threads=args.threads,
        kv_cache_dtype=args.kv_cache_dtype,
        **MODES[name],
    )
    engine = Engine(server_args, show_progress=False)
    forward_ms: list[float] = []
    decode(engine, prompt, args.steps, f"{name}-warm")
    timed_runner(engine, forward_ms)
    steps = decode(engine, prompt, args.steps, f"{name}-timed")
    forwards = forward_ms[-len(steps) :]
    prof = profile(activities=[ProfilerActivity.CPU])
    profiled = decode(engine, prompt, args.steps, f"{name}-prof", lambda: prof)
    counts = Counter()
    for event in prof.key_averages():
        if event.key.startswith("aten::"):
            counts[event.key] += event.count
    ops = sum(counts.values()) / len(profiled)  # the decode steps' own (no prefill)
    row = {"mode": name, "step_ms": statistics.median(steps),
           "forward_ms": statistics.median(forwards), "aten_ops_per_step": ops,
           "top_ops": counts.most_common(12)}  # fmt: skip
    row["engine_ms"] = row["step_ms"] - row["forward_ms"]
    context = len(prompt) + args.steps // 2  # the mean context of the timed steps
    row["mb_per_step"] = step_bytes(engine, context) / 1e6
    row["gb_s"] = row["mb_per_step"] / row["step_ms"]
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-path", default=str(default_model_path()))
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--modes", default="layered,fused,native")
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--json", default="bench/results/decode_profile.json")
    args = p.parse_args()
    vocab = json.loads((Path(args.model_path) / "config.json").read_text())["vocab_size"]
    rng = random.Random(0)
    prompt = [rng.randrange(32, vocab) for _ in range(args.prompt_len)]
    bandwidth = [stream_bandwidth(args.threads)]
    rows = [profile_mode(name, args, prompt) for name in args.modes.split(",")]
    bandwidth.append(stream_bandwidth(args.threads))
    stream = max(bandwidth)
    print(f"streaming read, {args.threads} thread(s): {bandwidth[0]:.1f} / {bandwidth[1]:.1f} GB/s "
          f"(before / after); load average {os.getloadavg()[0]:.1f}")  # fmt: skip
    print(
        "| path | step ms | forward ms | rest of step ms | aten ops / step | decode tok/s "
        "| MB read / step | GB/s | of stream |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        r["of_stream"] = r["gb_s"] / stream
        print(f"| {r['mode']} | {r['step_ms']:.2f} | {r['forward_ms']:.2f} | {r['engine_ms']:.2f} "
              f"| {r['aten_ops_per_step']:.0f} | {1e3 / r['step_ms']:.1f} "
              f"| {r['mb_per_step']:.1f} | {r['gb_s']:.1f} "
              f"| {100 * r['of_stream']:.0f}% |")  # fmt: skip
    for r in rows:
        print(r["mode"], "top ops per step:", ", ".join(f"{k[6:]} {v / (args.steps + 1):.0f}"
                                                        for k, v in r["top_ops"]))  # fmt: skip
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    result = {"args": vars(args), "load": list(os.getloadavg()), "stream_gb_s": bandwidth,
              "rows": rows}  # fmt: skip
    Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
