"""Side by side: dsaserve vs `transformers serve` on one checkpoint, same workloads, one run.

    python bench/side_by_side.py [--model-path DIR] [--concurrency 1,4,16,32] \
        [--input-len 128] [--output-len 128] [--prompts-per-level 2] [--threads N] \
        [--json bench/results/side_by_side.json] [--chart bench/results/side_by_side.png]

Both servers start once (each on a free port, same thread count, fp32) and stay up; for each
concurrency the same random chat workload (`dsaserve.bench.serving.run`, temperature 0, exact
lengths) runs on dsaserve, then on the reference, so machine noise hits both alike. The
reference rejects `ignore_eos`, so it gets a `generation_config` with min = max new tokens
instead; the table reports the output tokens each server really produced. Without
`--model-path` the embedded model is served (a random checkpoint of its architecture when its
weights are absent). Also measured: the machine's fp32 matmul peak (same thread count) and the
model FLOP/s achieved in dsaserve's batch-32 decode as a fraction of it. Both servers are always
stopped, whatever happens.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import sys
import tempfile
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import flops  # noqa: E402
import sbs_report as report  # noqa: E402
import sbs_servers as servers  # noqa: E402

from dsaserve.bench.serving import BenchError, run  # noqa: E402

START_TIMEOUT_S = 600.0
DETAIL_KEYS = ("requests",)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-path", help="checkpoint folder; default: the embedded model")
    p.add_argument("--concurrency", default="1,4,16,32", help="comma-separated levels")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument(
        "--prompts-per-level",
        type=float,
        default=2.0,
        help="requests per level = max(--min-prompts, this x concurrency)",
    )
    p.add_argument("--min-prompts", type=int, default=4)
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads of both servers and of the matmul peak (default 1: on a shared, "
        "oversubscribed machine extra threads mostly wait at OpenMP barriers)",
    )
    p.add_argument("--dsaserve-args", default="", help="extra `dsaserve serve` flags (one string)")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per request")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", default="bench/results/side_by_side.json", help="result file")
    p.add_argument("--chart", default="bench/results/side_by_side.png", help="PNG; '' for none")
    p.add_argument("--skip-peak", action="store_true", help="do not measure the matmul peak")
    p.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)  # smoke test model
    p.add_argument("--progress", action="store_true", help="show the bench progress bars")
    return p


def _levels(text: str) -> list[int]:
    try:
        levels = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise SystemExit(f"--concurrency: expected integers like 1,4,16,32, got {text!r}") from None
    if not levels or min(levels) <= 0:
        raise SystemExit(f"--concurrency: levels must be > 0, got {text!r}")
    return levels


def bench_argv(args: argparse.Namespace, url: str, model: Path, concurrency: int) -> list[str]:
    """`dsaserve bench` flags shared by both servers for one level."""
    prompts = max(args.min_prompts, round(args.prompts_per_level * concurrency))
    argv = ["--base-url", url, "--backend", "openai-chat", "--tokenizer", str(model),
            "--num-prompts", str(prompts), "--max-concurrency", str(concurrency),
            "--random-input-len", str(args.input_len), "--random-output-len",
            str(args.output_len), "--random-range-ratio", "1", "--seed", str(args.seed),
            "--timeout", str(args.timeout)]  # fmt: skip
    return argv if args.progress else [*argv, "--disable-progress"]


def peer_extra(model: Path, output_len: int) -> list[str]:
    """The reference: no ignore_eos (422), so EOS is masked until max_tokens by min_new_tokens."""
    config = {"max_new_tokens": output_len, "min_new_tokens": output_len, "do_sample": False}
    body = {"generation_config": json.dumps(config)}
    return ["--model", str(model), "--disable-ignore-eos", "--extra-request-body", json.dumps(body)]


def _run_one(argv: list[str]) -> dict[str, Any]:
    try:
        record = run(argv)
    except (BenchError, ValueError) as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    return {k: v for k, v in record.items() if k not in DETAIL_KEYS}


def run_levels(
    args: argparse.Namespace, model: Path, ours_url: str, peer_url: str
) -> list[dict[str, Any]]:
    """Each concurrency on dsaserve, then on the reference; ratios when both ran."""
    levels = []
    for conc in _levels(args.concurrency):
        level: dict[str, Any] = {"concurrency": conc, "load_before": os.getloadavg()[0]}
        print(f"concurrency {conc}: dsaserve ...", flush=True)
        level[report.OURS] = _run_one(bench_argv(args, ours_url, model, conc))
        print(f"concurrency {conc}: transformers serve ...", flush=True)
        extra = peer_extra(model, args.output_len)
        level[report.PEER] = _run_one([*bench_argv(args, peer_url, model, conc), *extra])
        level["load_after"] = os.getloadavg()[0]
        if "error" not in level[report.OURS] and "error" not in level[report.PEER]:
            level["ratios"] = report.ratios(level[report.OURS], level[report.PEER])
        levels.append(level)
    return levels


def _flops(
    model: Path, levels: list[dict], peak: flops.Peak | None, args: argparse.Namespace
) -> dict[str, Any]:
    top = next((lv for lv in levels if lv["concurrency"] == max(_levels(args.concurrency))), None)
    if peak is None or top is None:
        return {}
    per_token = flops.decode_flops_per_token(model, args.input_len + args.output_len / 2)
    out = {"concurrency": top["concurrency"], "peak": peak._asdict(),
           "params": flops.active_params(model)._asdict()}  # fmt: skip
    for name in (report.OURS, report.PEER):
        record = top.get(name) or {}
        if "error" not in record:
            batched = name == report.OURS  # the reference runs one request at a time
            out[name] = report.flops_summary(record, per_token, peak._asdict(), batched)
    return out


def serve_and_measure(args: argparse.Namespace, model: Path) -> dict[str, Any]:
    """Start both servers, run every level, stop both (always)."""
    env = servers.server_env(args.threads)
    ours_cmd = servers.dsaserve_command(model, shlex.split(args.dsaserve_args))
    port = servers.free_port()
    peer_url = f"http://127.0.0.1:{port}"
    peer_cmd = servers.peer_command(model, port)
    specs = [servers.ServerSpec(report.OURS, ours_cmd),
             servers.ServerSpec(report.PEER, peer_cmd, peer_url)]  # fmt: skip
    with servers.running(specs, env, START_TIMEOUT_S) as (ours, peer):
        pids = {report.OURS: ours.process.pid, report.PEER: peer.process.pid}
        levels = run_levels(args, model, ours.url, peer.url)
    return {"levels": levels, "server_pids": pids, "commands": {report.OURS: ours_cmd,
            report.PEER: peer_cmd}}  # fmt: skip


def tiny_overrides() -> dict[str, Any]:
    """A very small model of the same architecture, for the smoke test."""
    return dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                num_hidden_layers=2, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
                v_head_dim=16, index_topk=8, index_n_heads=4, index_head_dim=16)  # fmt: skip


def _exit_on_signals() -> None:
    """SIGTERM (and SIGINT, even where a background shell ignores it) unwind through the
    `finally` blocks, so both servers are stopped."""

    def stop(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGINT, stop)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = build_parser().parse_args(argv)
    _levels(args.concurrency)
    if not servers.peer_available():
        raise SystemExit("transformers serve is unavailable: pip install 'transformers[serving]' "
                         "accelerate")  # fmt: skip
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="dsaserve-sbs-") as scratch:
        overrides = tiny_overrides() if args.tiny else {}
        model, source = servers.prepare_checkpoint(args.model_path, Path(scratch), **overrides)
        peak = None if args.skip_peak else flops.matmul_peak(args.threads)
        measured = serve_and_measure(args, model)
        flops_result = _flops(model, measured["levels"], peak, args)
    result = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": " ".join(["python", "bench/side_by_side.py", *(argv or sys.argv[1:])]),
        "machine": {"cpus": os.cpu_count(), "threads": args.threads},
        "checkpoint": {"path": str(model) if source != "random" else None, "source": source},
        "workload": {
            "input_len": args.input_len,
            "output_len": args.output_len,
            "backend": "openai-chat",
            "temperature": 0,
        },  # fmt: skip
        **measured,
        "targets": report.targets(measured["levels"]),
        "flops": flops_result,
        "seconds": time.time() - started,
    }
    _print(result)
    _write(result, args)
    return result


def _print(result: dict[str, Any]) -> None:
    source, threads = result["checkpoint"]["source"], result["machine"]["threads"]
    print(f"\nSide by side ({source} checkpoint, {threads} thread(s) each; "
          "ratio = dsaserve / transformers):")  # fmt: skip
    print(report.format_table(result["levels"]))
    print("\nIssue 6 targets:")
    print(report.format_targets(result["targets"]))
    fl = result["flops"]
    if fl:
        peak = fl["peak"]
        print(f"\nfp32 matmul peak ({peak['threads']} thread(s)): best "
              f"{peak['best'] / 1e9:.1f} GFLOP/s, median {peak['median'] / 1e9:.1f}; model "
              f"{fl['params']['active'] / 1e6:.2f}M active matmul params per token")  # fmt: skip
        print(f"Achieved model FLOP/s at concurrency {fl['concurrency']}:")
        for name in (report.OURS, report.PEER):
            if name in fl:
                print(report.format_flops(name, fl[name]))


def _write(result: dict[str, Any], args: argparse.Namespace) -> None:
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
        print(f"\nwrote {args.json}")
    if args.chart:
        if report.write_chart(result["levels"], Path(args.chart)):
            print(f"wrote {args.chart}")
        else:
            print("no chart: matplotlib is not installed (pip install -e '.[bench]')")


if __name__ == "__main__":
    _exit_on_signals()
    main()
