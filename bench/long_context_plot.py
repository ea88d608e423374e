"""TTFT and decode ITL against the prompt length, as a hand-written SVG (no plotting library).

Two panels side by side, one line per cp size, log-scaled prompt length (and log TTFT: it grows
with the square of the prompt), linear ITL.
"""

from __future__ import annotations

import math
from pathlib import Path

PANEL_W, PANEL_H, MARGIN = 340, 240, 56
COLOURS = {1: "#1f77b4", 2: "#d62728"}


def _axis(values: list[float], log: bool) -> tuple[float, float]:
    lo, hi = min(values), max(values)
    if log:
        return math.log10(lo) - 0.1, math.log10(hi) + 0.1
    return 0.0, hi * 1.1


def _panel(runs: list[dict], key: str, title: str, log_y: bool, left: float) -> list[str]:
    xs = [r["prompt_tokens"] for r in runs]
    ys = [r[key] for r in runs]
    (x0, x1), (y0, y1) = _axis(xs, True), _axis(ys, log_y)

    def px(x: float) -> float:
        return left + MARGIN + (math.log10(x) - x0) / (x1 - x0) * (PANEL_W - MARGIN - 10)

    def py(y: float) -> float:
        v = math.log10(y) if log_y else y
        return 20 + (1 - (v - y0) / (y1 - y0)) * (PANEL_H - 60)

    bottom, right = PANEL_H - 40, left + PANEL_W - 10
    out = [f'<text x="{left + PANEL_W / 2}" y="14" text-anchor="middle">{title}</text>',
           f'<line x1="{left + MARGIN}" y1="{bottom}" x2="{right}" y2="{bottom}" stroke="black"/>',
           f'<line x1="{left + MARGIN}" y1="20" x2="{left + MARGIN}" y2="{bottom}" '
           'stroke="black"/>']  # fmt: skip
    for x in sorted(set(xs)):
        out.append(f'<text x="{px(x):.1f}" y="{bottom + 14}" text-anchor="middle">'
                   f"{x // 1024}k</text>")  # fmt: skip
    decades = [10.0**e for e in range(math.ceil(y0), math.floor(y1) + 1)]
    ticks = decades if log_y else [y1 * i / 4 / 1.1 for i in range(5)]
    for y in ticks:
        label = f"{y:.3g}"
        out.append(f'<text x="{left + MARGIN - 4}" y="{py(y) + 4:.1f}" text-anchor="end">'
                   f"{label}</text>")  # fmt: skip
    out.append(f'<text x="{left + PANEL_W / 2}" y="{PANEL_H - 8}" text-anchor="middle">'
               "prompt tokens (log)</text>")  # fmt: skip
    for cp in sorted({r["cp"] for r in runs}):
        mine = sorted((r for r in runs if r["cp"] == cp), key=lambda r: r["prompt_tokens"])
        points = " ".join(f"{px(r['prompt_tokens']):.1f},{py(r[key]):.1f}" for r in mine)
        colour = COLOURS.get(cp, "black")
        out.append(f'<polyline points="{points}" fill="none" stroke="{colour}" '
                   'stroke-width="2"/>')  # fmt: skip
        for r in mine:
            out.append(f'<circle cx="{px(r["prompt_tokens"]):.1f}" cy="{py(r[key]):.1f}" r="3" '
                       f'fill="{colour}"/>')  # fmt: skip
    return out


def write_plot(runs: list[dict], path: Path) -> None:
    """TTFT (s, log) and ITL (ms) against the prompt length, one line per cp size."""
    width = 2 * PANEL_W + 20
    body = _panel(runs, "ttft_s", "TTFT, s (log scale)", True, 0)
    body += _panel(runs, "itl_ms", "decode ITL, ms", False, PANEL_W + 20)
    for i, cp in enumerate(sorted({r["cp"] for r in runs})):
        y = PANEL_H + 6 + 14 * i
        body.append(f'<rect x="{MARGIN}" y="{y - 9}" width="14" height="4" '
                    f'fill="{COLOURS.get(cp, "black")}"/>')  # fmt: skip
        body.append(f'<text x="{MARGIN + 20}" y="{y - 4}">cp {cp}</text>')
    height = PANEL_H + 14 * len({r["cp"] for r in runs}) + 6
    svg = (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'font-family="sans-serif" font-size="11">\n<rect width="100%" height="100%" '
           f'fill="white"/>\n' + "\n".join(body) + "\n</svg>\n")  # fmt: skip
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(svg)
