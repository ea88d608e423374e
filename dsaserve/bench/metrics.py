"""Aggregate per-request measurements into the benchmark report, and print it as a table.

Key names follow sglang.bench_serving's JSON (`mean_ttft_ms`, `output_throughput`, ...) so
existing dashboards and scripts read dsaserve results unchanged.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from typing import Any

from dsaserve.bench.client import RequestResult

_STATS = (("mean", None), ("median", 50.0), ("p90", 90.0), ("p99", 99.0))
_LATENCIES = (  # (key, short label, section title)
    ("ttft", "TTFT", "Time to first token"),
    ("itl", "ITL", "Inter-token latency"),
    ("tpot", "TPOT", "Time per output token (excl. 1st)"),
    ("e2e_latency", "E2E latency", "End-to-end latency"),
)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile with linear interpolation (numpy's default); NaN when empty."""
    if not values:
        return math.nan
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100.0
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def _stats_ms(name: str, values_s: Sequence[float]) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for stat, q in _STATS:
        if not values_s:
            out[f"{stat}_{name}_ms"] = None
            continue
        value = sum(values_s) / len(values_s) if q is None else percentile(values_s, q)
        out[f"{stat}_{name}_ms"] = value * 1000.0
    return out


def _tpot(result: RequestResult) -> float | None:
    if result.output_len <= 1:
        return None
    return (result.latency - result.ttft) / (result.output_len - 1)


def _cache_report(ok: list[RequestResult]) -> dict[str, Any]:
    reported = [r for r in ok if r.cached_tokens is not None]
    if not reported:  # the server does not report cache hits (sglang: --enable-cache-report)
        return {"total_cached_tokens": None, "cached_token_ratio": None}
    cached = sum(r.cached_tokens or 0 for r in ok)
    prompt = sum(r.prompt_len for r in ok)
    return {"total_cached_tokens": cached, "cached_token_ratio": cached / prompt if prompt else 0.0}


def _request_accept_length(ok: list[RequestResult]) -> float | None:
    counted = [r for r in ok if r.spec_verify_ct]
    if not counted:
        return None
    return sum(r.output_len for r in counted) / sum(r.spec_verify_ct or 0 for r in counted)


def _error_report(failed: list[RequestResult]) -> dict[str, Any]:
    examples: dict[str, str] = {}
    for result in failed:
        examples.setdefault(result.error_kind, result.error)
    return {"errors": dict(Counter(r.error_kind for r in failed)), "error_examples": examples}


def summarize(
    results: Sequence[RequestResult], duration: float, server_accept_length: float | None
) -> dict[str, Any]:
    """The report's numbers (times in ms, rates per second) over all requests of one run."""
    ok = [r for r in results if r.success]
    failed = [r for r in results if not r.success]
    input_tokens = sum(r.prompt_len for r in ok)
    output_tokens = sum(r.output_len for r in ok)
    safe_duration = max(duration, 1e-9)
    report: dict[str, Any] = {
        "completed": len(ok),
        "failed": len(failed),
        "duration": duration,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(ok) / safe_duration,
        "input_throughput": input_tokens / safe_duration,
        "output_throughput": output_tokens / safe_duration,
        "total_throughput": (input_tokens + output_tokens) / safe_duration,
        "concurrency": sum(r.latency for r in ok) / safe_duration,
    }
    report |= _stats_ms("ttft", [r.ttft for r in ok])
    report |= _stats_ms("itl", [gap for r in ok for gap in r.itl])
    report |= _stats_ms("tpot", [t for r in ok if (t := _tpot(r)) is not None])
    report |= _stats_ms("e2e_latency", [r.latency for r in ok])
    report |= _cache_report(ok)
    accept = server_accept_length
    report["accept_length"] = accept if accept is not None else _request_accept_length(ok)
    return report | _error_report(failed)


def _fmt(value: Any, digits: int = 2) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def format_table(report: dict[str, Any], header: dict[str, Any]) -> str:
    """The human-readable result table (sglang.bench_serving layout)."""
    lines = ["{s:{c}^60}".format(s=" Serving Benchmark Result ", c="=")]
    row = lambda label, value: lines.append(f"{label + ':':<45}{_fmt(value):>15}")
    for label, value in header.items():
        row(label, value)
    row("Successful requests", report["completed"])
    row("Failed requests", report["failed"])
    for kind, count in report["errors"].items():
        row(f"  {kind}"[:44], count)
    row("Benchmark duration (s)", report["duration"])
    row("Total input tokens", report["total_input_tokens"])
    row("Total generated tokens", report["total_output_tokens"])
    row("Request throughput (req/s)", report["request_throughput"])
    row("Input token throughput (tok/s)", report["input_throughput"])
    row("Output token throughput (tok/s)", report["output_throughput"])
    row("Concurrency", report["concurrency"])
    row("Cached-token ratio", report["cached_token_ratio"])
    row("Accept length", report["accept_length"])
    for key, short, title in _LATENCIES:
        lines.append("{s:{c}^60}".format(s=f" {title} ", c="-"))
        for stat, label in (("mean", "Mean"), ("median", "P50"), ("p99", "P99")):
            row(f"{label} {short} (ms)", report[f"{stat}_{key}_ms"])
    lines.append("=" * 60)
    return "\n".join(lines)
