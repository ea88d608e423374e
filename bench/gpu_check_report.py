"""Tables and verdicts of a compile report (bench/gpu_check_compile.py's JSON): per kernel and
target, or per kernel configuration.

    python bench/gpu_check_report.py gpu_compile.json [--detail | --pivot]

--pivot: a row per kernel configuration, a column per target (registers, spill stores, shared
memory, instruction): the table docs/gpu.md keeps.

A configuration fails (`problems`) when it does not compile, spills, needs more shared memory
than the target has, or issues another matrix instruction than its tile allows
(`expected_family`): 16-bit / FP8 dots compiled to FMAs fail there, IEEE fp32 dots are FMAs.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

COLUMNS = ("kernel", "target", "launches", "compiles", "failed", "spilling", "registers",
           "spill_stores", "shared", "over_shared", "family", "expected",
           "wrong_family")  # fmt: skip
# the instruction of a 16-bit / FP8 tile whose M is 64 or more: warp-group MMA where the target
# has one (kernels/gpu_target.py: has_wgmma), mma.sync elsewhere
WIDE = {90: "wgmma", 100: "tcgen05", 103: "tcgen05"}
TENSOR_CORES = ("wgmma", "tcgen05", "mma")


DTYPES = {"*u8": "fp8", "*fp8e4nv": "fp8"}  # FP8 caches are raw bytes


def config(result: dict) -> str:
    """A configuration's name: what it reads and its tile (the constexprs that pick it)."""
    c, sig = result["constexprs"], result["signature"]
    dtype = lambda name: DTYPES.get(sig[name], sig[name][1:])  # noqa: E731
    if "BLOCK_L" in c:  # the indexer
        return f"{dtype('q_ptr')} query, {dtype('cache_ptr')} keys, {c['BLOCK_H']} heads"
    if "G" in c:  # the DFLASH drafter's attention
        return f"{dtype('q_ptr')} query, {dtype('cache_ptr')} cache, {c['BLOCK_M']} rows"
    if "BLOCK_H" in c:  # sparse MLA
        dots = f", {c['DOT']} dots" if "DOT" in c else ""
        return f"{dtype('q_ptr')} query, {dtype('cache_ptr')} cache{dots}, {c['BLOCK_H']} heads"
    swap = ", swap-AB" if c.get("SWAP") else ""
    return f"{dtype('w_ptr')} weights, {c['BLOCK_M']} rows{swap}"


def _tile_m(result: dict) -> int | None:
    """The M of the tile's dots where they are 16-bit / FP8 (None: IEEE fp32 dots)."""
    kernel, c = result["kernel"], result["constexprs"]
    if kernel in ("_indexer_scores_kernel", "_sparse_mla_kernel"):
        if c.get("DOT", "fp32") == "fp32":  # older reports: the indexer was fp32 only
            return None
        # the indexer is swap-AB: a block's keys are the M; sparse MLA: the heads
        return c["BLOCK_L"] if kernel == "_indexer_scores_kernel" else c["BLOCK_H"]
    if c.get("IEEE"):
        return None
    return 128 if c.get("SWAP") else c["BLOCK_M"]  # swapped: the weight's 128 rows


def expected_family(result: dict) -> str:
    """The instruction a kernel's tile allows: FMAs for IEEE fp32 dots; for 16-bit / FP8 dots
    wgmma (sm_90) / tcgen05 (sm_100, sm_103) where M >= 64, else mma.sync."""
    m = _tile_m(result)
    if m is None:
        return "fma"
    return WIDE.get(result["target"], "mma") if m >= 64 else "mma"


def problems(result: dict) -> list[str]:
    """Why a compiled configuration fails (empty: it passes)."""
    where = f"{result['kernel']} sm_{result['target']} {result['constexprs']}"
    where += f" ({result['labels'][0]})" if result.get("labels") else ""
    if not result["ok"]:
        return [f"{where}: {result['error'][:300]}"]
    found = []
    if result["spill_stores"]:
        found.append(f"{where}: {result['spill_stores']} B of spill stores")
    if result["shared"] > result["shared_limit"]:
        found.append(f"{where}: {result['shared']} B of shared memory > {result['shared_limit']}")
    if result["family"] != expected_family(result):
        found.append(f"{where}: {result['family']} ({result['mma']}), not "
                     f"{expected_family(result)}")  # fmt: skip
    return found


def _row(name: str, target: int, rs: list[dict]) -> dict:
    ok = [r for r in rs if r["ok"]]
    return {
        "kernel": name, "target": f"sm_{target}", "launches": sum(r["launches"] for r in rs),
        "compiles": len(rs), "failed": len(rs) - len(ok),
        "spilling": sum(r["spill_stores"] > 0 for r in ok),
        "registers": _range(r["registers"] for r in ok),
        "spill_stores": _range(r["spill_stores"] for r in ok),
        "shared": _range(r["shared"] for r in ok),
        "over_shared": sum(r["shared"] > r["shared_limit"] for r in ok),
        "family": " ".join(sorted({r["family"] for r in ok})),
        "expected": " ".join(sorted({expected_family(r) for r in ok})),
        "wrong_family": sum(r["family"] != expected_family(r) for r in ok),
    }  # fmt: skip


def _name(kernel: str) -> str:
    return kernel.strip("_").removesuffix("_kernel")


def summary(results: list[dict]) -> list[dict]:
    """Per (kernel, target): launches, compiles, failures, register / spill / shared ranges, the
    instruction families."""
    groups = defaultdict(list)
    for r in results:
        groups[(r["kernel"], r["target"])].append(r)
    return [_row(_name(k), cc, rs) for (k, cc), rs in sorted(groups.items())]


def detail(results: list[dict]) -> list[dict]:
    """The same per (kernel, configuration, target)."""
    groups = defaultdict(list)
    for r in results:
        groups[(r["kernel"], config(r), r["target"])].append(r)
    return [_row(f"{_name(k)}: {c}", cc, rs) for (k, c, cc), rs in sorted(groups.items())]


def _range(values) -> str:
    values = sorted(values)
    if not values:
        return "-"
    return str(values[0]) if values[0] == values[-1] else f"{values[0]}-{values[-1]}"


def table(rows: list[dict]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(str(r[c]) for c in COLUMNS) + " |" for r in rows]
    return "\n".join(lines)


def pivot(results: list[dict]) -> str:
    """Per configuration (with its launch count) a cell per target: registers / spill-store
    bytes / shared KB / instruction (ranges where compiles of one configuration differ)."""
    rows = detail(results)
    targets = sorted({r["target"] for r in rows}, key=lambda t: int(t[3:]))
    cells: dict[str, dict[str, str]] = defaultdict(dict)
    launches: dict[str, int] = {}
    for r in rows:
        shared = _range(int(x) // 1024 for x in r["shared"].split("-")) if r["compiles"] else "-"
        cells[r["kernel"]][r["target"]] = (
            f"{r['registers']} / {r['spill_stores']} / {shared} / {r['family']}"
            + (f" ({r['failed']} failed)" if r["failed"] else "")
        )
        launches[r["kernel"]] = r["launches"]
    head = ["configuration", "launches", *targets]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += [f"| {name} | {launches[name]} | " + " | ".join(by.get(t, "-") for t in targets)
              + " |" for name, by in cells.items()]  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Tables of a compile report")
    parser.add_argument("report", type=Path)
    parser.add_argument("--detail", action="store_true")
    parser.add_argument("--pivot", action="store_true")
    args = parser.parse_args(argv)
    results = json.loads(args.report.read_text())["results"]
    if args.pivot:
        print(pivot(results))
    else:
        print(table(detail(results) if args.detail else summary(results)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
