"""Where a dsaserve engine step goes under a concurrency-32 decode load (py-spy sampling).

    python bench/profile_server.py [--model-path DIR] [--concurrency 32] [--duration 20] \
        [--output-len 256] [--out bench/results/profile.md]

Starts `dsaserve serve` (metrics on), sends `--concurrency` random chat requests at once, waits
until every one has its first token (the TTFT count in /metrics) so the engine is decoding only,
then samples the engine process with `py-spy record` for `--duration` seconds and prints the
breakdown as markdown: the share of samples inside `Engine.step`, the inclusive share of the
dsaserve functions below it, and the self time by the deepest dsaserve source line (a line that
calls into torch is charged with the op, and the torch function is named after the arrow). The
server is always stopped.
"""

from __future__ import annotations

import argparse
import collections
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import sbs_servers as servers  # noqa: E402

from dsaserve.bench.serving import run  # noqa: E402

FRAME = re.compile(r"^(?P<func>.+) \((?P<file>[^()]*?)(?::(?P<line>\d+))?\)$")
STEP = "Engine.step"


def parse_raw(path: Path) -> list[tuple[list[str], int]]:
    """py-spy's raw (collapsed) output: `frame;frame;... count` per line."""
    stacks = []
    for line in path.read_text().splitlines():
        if line.strip():
            stack, count = line.rsplit(" ", 1)
            stacks.append((stack.split(";"), int(count)))
    return stacks


def _name(frame: str, with_line: bool) -> str:
    match = FRAME.match(frame)
    if not match:
        return frame
    where = match["file"] + (f":{match['line']}" if with_line and match["line"] else "")
    return f"{match['func']} ({where})"


def _self_key(frames: list[str]) -> str:
    """The deepest dsaserve line, and the library function it was in when sampled."""
    ours = [f for f in frames if "dsaserve/" in f]
    key = _name(ours[-1], True) if ours else _name(frames[-1], True)
    if ours and frames[-1] is not ours[-1]:
        match = FRAME.match(frames[-1])
        key += f" -> {match['func'] if match else frames[-1]}"
    return key


def breakdown(stacks: list[tuple[list[str], int]], top: int = 25) -> dict:
    """Inclusive shares of dsaserve frames and self shares by line, as % of in-step samples."""
    total = sum(n for _, n in stacks)
    in_step = [(frames, n) for frames, n in stacks if any(STEP in f for f in frames)]
    step_total = sum(n for _, n in in_step) or 1
    inclusive: collections.Counter[str] = collections.Counter()
    self_time: collections.Counter[str] = collections.Counter()
    for frames, n in in_step:
        start = next(i for i, f in enumerate(frames) if STEP in f)
        below = frames[start:]
        for name in {_name(f, False) for f in below if "dsaserve/" in f}:
            inclusive[name] += n
        self_time[_self_key(below)] += n
    pct = 100.0 / step_total
    return {
        "samples": total,
        "step_share": 100.0 * step_total / max(total, 1),
        "inclusive": [(k, v * pct) for k, v in inclusive.most_common(top)],
        "self": [(k, v * pct) for k, v in self_time.most_common(top)],
    }


def to_markdown(result: dict, meta: str) -> str:
    lines = [textwrap.fill(meta, 100), "", f"Samples: {result['samples']}, inside `Engine.step`: "
             f"{result['step_share']:.1f}% (the rest: waiting for work, IPC, idle threads). "
             "Nested calls count in every caller (the indexer runs inside `MLAttention.forward`).",
             "", "| % of step (inclusive) | function |", "|---:|---|"]  # fmt: skip
    lines += [f"| {share:.1f} | `{name}` |" for name, share in result["inclusive"]]
    lines += ["", "| % of step (self) | line |", "|---:|---|"]
    lines += [f"| {share:.1f} | `{name}` |" for name, share in result["self"]]
    return "\n".join(lines)


def _ttft_count(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=5).text
    match = re.search(r"^sglang:time_to_first_token_seconds_count\{[^}]*\} (\S+)$", text, re.M)
    return float(match.group(1)) if match else 0.0


def _wait_all_decoding(url: str, baseline: float, concurrency: int, timeout: float) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if _ttft_count(url) >= baseline + concurrency:
            return time.monotonic() - start
        time.sleep(0.5)
    raise RuntimeError(f"not all {concurrency} requests started decoding in {timeout:.0f}s")


def _load(url: str, model: Path, args: argparse.Namespace, out: dict) -> None:
    argv = ["--base-url", url, "--tokenizer", str(model), "--num-prompts", str(args.concurrency),
            "--max-concurrency", str(args.concurrency), "--random-input-len", str(args.input_len),
            "--random-output-len", str(args.output_len), "--random-range-ratio", "1",
            "--warmup-requests", "0", "--disable-progress"]  # fmt: skip
    try:
        out["record"] = run(argv)
    except Exception as exc:  # the server went away (profiling failed): report, do not hang
        out["error"] = f"{type(exc).__name__}: {exc}"


def profile(args: argparse.Namespace, model: Path, raw: Path) -> tuple[dict, dict]:
    env = servers.server_env(args.threads)
    cmd = servers.dsaserve_command(model, ["--enable-metrics"])
    with servers.running([servers.ServerSpec("dsaserve", cmd)], env, 600) as (server,):
        pid = httpx.get(f"{server.url}/get_server_info", timeout=5).json()["engine_pid"]
        baseline = _ttft_count(server.url)
        out: dict = {}
        load = threading.Thread(target=_load, args=(server.url, model, args, out), daemon=True)
        load.start()
        waited = _wait_all_decoding(server.url, baseline, args.concurrency, 900)
        print(f"all {args.concurrency} decoding after {waited:.0f}s; sampling pid {pid}")
        spy = [shutil.which("py-spy") or "py-spy", "record", "-p", str(pid), "-d",
               str(args.duration), "-r", str(args.rate), "-f", "raw", "-o", str(raw),
               "--nonblocking"]  # fmt: skip
        done = subprocess.run(spy, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"py-spy failed: {done.stderr.strip()[-1000:]}")
        load.join()
    return breakdown(parse_raw(raw), args.top), out.get("record", {})


def _meta(args: argparse.Namespace, source: str, record: dict) -> str:
    tpot = record.get("mean_tpot_ms")
    commit = subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True,
                            text=True).stdout.strip() or "unknown"  # fmt: skip
    return (f"Code at `{commit}`, {source} checkpoint, {args.concurrency} requests at once "
            f"({args.input_len} in, {args.output_len} out), {args.threads} thread(s), sampled "
            f"{args.duration} s at {args.rate} Hz; mean TPOT over the run "
            f"{'-' if tpot is None else f'{tpot:.0f}'} ms.")  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-path", help="checkpoint; default: the embedded model (or random)")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--duration", type=int, default=20, help="seconds of sampling")
    ap.add_argument("--rate", type=int, default=50, help="samples per second")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--raw", default="", help="keep py-spy's raw stacks here")
    ap.add_argument("--out", default="bench/results/profile.md")
    args = ap.parse_args(argv)
    if shutil.which("py-spy") is None:
        raise SystemExit("py-spy is not installed: pip install -e '.[bench]'")
    with tempfile.TemporaryDirectory(prefix="dsaserve-prof-") as scratch:
        model, source = servers.prepare_checkpoint(args.model_path, Path(scratch))
        raw = Path(args.raw) if args.raw else Path(scratch) / "stacks.txt"
        result, record = profile(args, model, raw)
    text = to_markdown(result, _meta(args, source, record))
    print(text)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
