"""Side-by-side report: table, ratios, issue-6 targets, FLOP/s fraction of peak, chart."""

from __future__ import annotations

from pathlib import Path
from typing import Any

OURS, PEER = "dsaserve", "transformers"
COLUMNS = [  # (header, record key, format)
    ("done", "completed", "{:.0f}"),
    ("fail", "failed", "{:.0f}"),
    ("out tok", "total_output_tokens", "{:.0f}"),
    ("out tok/s", "output_throughput", "{:.1f}"),
    ("p50 TTFT ms", "median_ttft_ms", "{:.0f}"),
    ("p99 TTFT ms", "p99_ttft_ms", "{:.0f}"),
    ("p50 ITL ms", "median_itl_ms", "{:.1f}"),
    ("p50 TPOT ms", "median_tpot_ms", "{:.1f}"),
    ("p50 E2E ms", "median_e2e_latency_ms", "{:.0f}"),
]
RATIO_KEYS = ["output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_itl_ms",
              "median_tpot_ms", "median_e2e_latency_ms"]  # fmt: skip


def _cell(value: Any, fmt: str) -> str:
    return "-" if value is None else fmt.format(value)


def ratios(ours: dict[str, Any], peer: dict[str, Any]) -> dict[str, float | None]:
    """dsaserve / reference for each key (throughput: higher is better; latency: lower)."""
    out: dict[str, float | None] = {}
    for key in RATIO_KEYS:
        a, b = ours.get(key), peer.get(key)
        out[key] = a / b if a is not None and b else None
    return out


def format_table(levels: list[dict[str, Any]]) -> str:
    head = f"{'conc':>5}  {'server':<13}" + "".join(f"{h:>13}" for h, _, _ in COLUMNS)
    lines = [head, "-" * len(head)]
    for level in levels:
        conc = level["concurrency"]
        for name in (OURS, PEER):
            record = level.get(name) or {}
            cells = "".join(f"{_cell(record.get(k), f):>13}" for _, k, f in COLUMNS)
            if "error" in record:
                cells = f"  error: {record['error'][:80]}"
            lines.append(f"{conc:>5}  {name:<13}{cells}")
        ratio = level.get("ratios") or {}
        cells = "".join(
            f"{_cell(ratio.get(k), '{:.2f}x'):>13}" if k in RATIO_KEYS else f"{'':>13}"
            for _, k, _ in COLUMNS
        )
        lines.append(f"{conc:>5}  {'ratio d/t':<13}{cells}")
    return "\n".join(lines)


def _level(levels: list[dict[str, Any]], concurrency: int) -> dict[str, Any] | None:
    return next((lv for lv in levels if lv["concurrency"] == concurrency), None)


def _target(level: dict[str, Any] | None, key: str, goal: str, passes) -> dict[str, Any]:
    if level is None or not level.get("ratios") or level["ratios"].get(key) is None:
        return {"goal": goal, "measured": None, "met": None}
    value = level["ratios"][key]
    ours, peer = level[OURS].get(key), level[PEER].get(key)
    return {"goal": goal, "measured": value, "dsaserve": ours, "transformers": peer,
            "met": bool(passes(value))}  # fmt: skip


def targets(levels: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Issue 6: c=32 output tok/s >= 8x; c=16 p50 TTFT below; batch-1 p50 ITL no worse."""
    return {
        "c32_output_throughput": _target(_level(levels, 32), "output_throughput",
                                         ">= 8x reference", lambda r: r >= 8.0),
        "c16_p50_ttft": _target(_level(levels, 16), "median_ttft_ms", "< reference",
                                lambda r: r < 1.0),
        "c1_p50_itl": _target(_level(levels, 1), "median_itl_ms", "<= reference",
                              lambda r: r <= 1.0),
    }  # fmt: skip


def format_targets(result: dict[str, dict[str, Any]]) -> str:
    lines = []
    for name, t in result.items():
        verdict = {True: "MET", False: "NOT MET", None: "n/a"}[t["met"]]
        measured = "-" if t["measured"] is None else f"{t['measured']:.2f}x"
        lines.append(f"  {name:<24} goal {t['goal']:<18} measured {measured:>8}  {verdict}")
    return "\n".join(lines)


def flops_summary(
    record: dict[str, Any], per_token: float, peak: dict[str, Any], batched: bool = True
) -> dict:
    """Achieved model FLOP/s of one run: whole run ((input + output tokens) / duration), and, for
    a batching server (`batched`), its decode rate (concurrency / mean TPOT: every request in
    flight gains one token per step). A server that runs one request at a time has no batch
    decode rate."""
    concurrency = record.get("max_concurrency") or 1
    tpot = record.get("mean_tpot_ms")
    decode_tok_s = concurrency / (tpot / 1000) if tpot and batched else None
    run_tok_s = record.get("total_throughput")  # input + output tokens over the run
    decode = decode_tok_s * per_token if decode_tok_s else None
    whole = run_tok_s * per_token if run_tok_s else None
    return {
        "flops_per_token": per_token,
        "decode_tokens_per_s": decode_tok_s,
        "decode_flops_per_s": decode,
        "run_flops_per_s": whole,
        "peak_flops_per_s": peak["best"],
        "decode_fraction_of_peak": decode / peak["best"] if decode else None,
        "run_fraction_of_peak": whole / peak["best"] if whole else None,
    }


def format_flops(name: str, summary: dict[str, Any]) -> str:
    if summary.get("run_flops_per_s") is None:
        return f"  {name}: no completed run"
    if summary.get("decode_flops_per_s") is None:
        return (f"  {name}: whole run, prefill included: {summary['run_flops_per_s'] / 1e9:.3f}"
                f" GFLOP/s = {100 * summary['run_fraction_of_peak']:.2f}% of peak")  # fmt: skip
    return (
        f"  {name}: {summary['decode_tokens_per_s']:.1f} decode tok/s x "
        f"{summary['flops_per_token'] / 1e6:.2f} MFLOP = "
        f"{summary['decode_flops_per_s'] / 1e9:.3f} GFLOP/s = "
        f"{100 * summary['decode_fraction_of_peak']:.2f}% of peak "
        f"(whole run, prefill included: {100 * summary['run_fraction_of_peak']:.2f}%)"
    )


def write_chart(levels: list[dict[str, Any]], path: Path) -> bool:
    """Output tok/s and p50 TTFT vs concurrency, both servers; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for name, marker in ((OURS, "o"), (PEER, "s")):
        points = [(lv["concurrency"], lv.get(name) or {}) for lv in levels]
        xs = [c for c, r in points if r.get("output_throughput") is not None]
        left.plot(xs, [r["output_throughput"] for _, r in points if r.get("output_throughput")
                       is not None], marker=marker, label=name)  # fmt: skip
        ttft = [(c, r["median_ttft_ms"]) for c, r in points if r.get("median_ttft_ms")]
        right.plot([c for c, _ in ttft], [t for _, t in ttft], marker=marker, label=name)
    left.set(xscale="log", xlabel="concurrency", ylabel="output tokens/s", title="Throughput")
    right.set(xscale="log", yscale="log", xlabel="concurrency", ylabel="p50 TTFT (ms)",
              title="Time to first token")  # fmt: skip
    ticks = [lv["concurrency"] for lv in levels]
    for ax in (left, right):
        ax.set_xticks(ticks, [str(c) for c in ticks])
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True
