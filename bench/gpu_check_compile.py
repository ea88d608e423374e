"""Compile every recorded Triton launch ahead of time for GPU targets, on a CPU-only machine.

    python bench/gpu_check_compile.py                      # sm_90 and sm_100: table + JSON
    python bench/gpu_check_compile.py --targets 80 89 120  # the other targets (informational)

Each launch that bench/gpu_check_launches.py records (our launch code at every shape we claim)
is specialised as Triton's runtime would specialise it for the target (argument dtypes, the
integers that are multiples of 16, the constexprs and launch options), deduplicated, and
compiled with `triton.compile(ASTSource(...), target=GPUTarget("cuda", cc, 32))`, which runs
the wheel's bundled ptxas. From ptxas's `-v` log: registers, spill stores / loads, stack; from
the compiled kernel: Triton's shared memory (checked against the target's per-block limit) and
the PTX's matrix instruction (wgmma, tcgen05, mma.sync, or none: FMAs) against the one the
tile allows (bench/gpu_check_report.py: `expected_family`; the script exits 1 and prints a FAIL
line for each configuration that spills, overflows shared memory, fails to compile or issues
another instruction, e.g. FMAs for 16-bit / FP8 dots). Results are cached by
the specialisation's hash (kernel source and its dependencies, signature, constexprs, target,
options, Triton version) under --cache, so only a changed kernel compiles again.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import hashlib
import importlib
import io
import json
import os
import re
import sys
import tempfile
import time
from collections import defaultdict
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.pop("TRITON_INTERPRET", None)  # compile for real (the kernels are JITFunctions)

import torch  # noqa: E402
import triton  # noqa: E402
from gpu_check_report import detail, expected_family, problems, summary, table  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, make_backend  # noqa: E402
from triton.runtime.jit import create_function_from_signature  # noqa: E402

TARGETS = (90, 100)  # H100 / H200, B200: the ones CI checks
# cudaDevAttrMaxSharedMemoryPerBlockOptin, what Triton checks a launch against
SHARED_LIMIT = {80: 166912, 86: 101376, 89: 101376, 90: 232448, 100: 232448, 103: 232448,
                120: 101376}  # fmt: skip
DEFAULT_CACHE = Path(os.environ.get("TRITON_CACHE_DIR", Path.home() / ".triton/cache")).parent
CPU = torch.device("cpu")  # what the recorded launch code runs on (its target is forced)
MMA = (("tcgen05", r"tcgen05\.mma\.\S+"), ("wgmma", r"wgmma\.mma_async\.\S+"),
       ("mma", r"\bmma\.sync\.\S+"))  # fmt: skip


@functools.cache
def _binder(kernel, cc: int):
    backend = make_backend(GPUTarget("cuda", cc, 32))
    return backend, create_function_from_signature(kernel.signature, kernel.params, backend)


def specialize(kernel, args: tuple, kwargs: dict, cc: int) -> tuple:
    """(options, signature, constexprs, attrs) as JITFunction.run computes them for target cc."""
    backend, binder = _binder(kernel, cc)
    bound, specialization, options = binder(*args, **kwargs)
    return kernel._pack_args(backend, kwargs, bound, specialization, options)


def spec_key(kernel, args: tuple, kwargs: dict, cc: int, memo: dict) -> str:
    """The specialisation's identity: kernel source and dependencies, signature, constexprs,
    attributes, options, target and Triton version (memoised by Triton's own launch key)."""
    _, binder = _binder(kernel, cc)
    _, specialization, options = binder(*args, **kwargs)
    fast = (kernel, cc, str(specialization), str(sorted(options.items())))
    if fast not in memo:
        options, signature, constexprs, attrs = specialize(kernel, args, kwargs, cc)
        source = ASTSource(kernel, signature, constexprs, attrs).hash()
        text = f"{triton.__version__}-{source}-{cc}-{sorted(options.__dict__.items())}"
        memo[fast] = hashlib.sha256(text.encode()).hexdigest()[:24]
    return memo[fast]


def parse_ptxas(log: str) -> dict:
    """Registers, spill stores / loads and stack frame bytes from `ptxas -v`."""
    regs = re.search(r"Used (\d+) registers", log)
    frame = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill "
                      r"loads", log)  # fmt: skip
    stack, stores, loads = (int(x) for x in frame.groups()) if frame else (0, 0, 0)
    return {"registers": int(regs.group(1)) if regs else None, "spill_stores": stores,
            "spill_loads": loads, "stack": stack}  # fmt: skip


def instruction(ptx: str) -> tuple[str, str]:
    """The matrix instruction family in the PTX and its first full name ('fma', '' if none)."""
    for family, pattern in MMA:
        found = re.search(pattern, ptx)
        if found:
            return family, found.group(0)
    return "fma", ""


def compile_one(job: tuple) -> dict:
    """Compile one specialisation for one target (in a worker process); a result dict."""
    module, name, args, kwargs, cc = job
    kernel = getattr(importlib.import_module(module), name)
    options, signature, constexprs, attrs = specialize(kernel, args, kwargs, cc)
    result = {"kernel": name, "target": cc, "num_warps": options.num_warps,
              "num_stages": options.num_stages, "shared_limit": SHARED_LIMIT.get(cc),
              "constexprs": {kernel.arg_names[k[0]]: _plain(v) for k, v in constexprs.items()},
              "signature": {k: v for k, v in signature.items() if v != "constexpr"}}  # fmt: skip
    log = io.StringIO()
    started = time.perf_counter()
    try:
        source = ASTSource(kernel, signature, constexprs, attrs)
        with contextlib.redirect_stdout(log):
            compiled = triton.compile(source, target=GPUTarget("cuda", cc, 32),
                                      options=options.__dict__)  # fmt: skip
    except Exception as e:  # noqa: BLE001 (a compile error is the result)
        return {**result, "ok": False, "error": f"{type(e).__name__}: {str(e)[-2000:]}",
                "seconds": time.perf_counter() - started}  # fmt: skip
    family, mma = instruction(compiled.asm["ptx"])
    return {**result, **parse_ptxas(log.getvalue()), "ok": True, "error": "",
            "shared": compiled.metadata.shared, "family": family, "mma": mma,
            "seconds": time.perf_counter() - started}  # fmt: skip


def _plain(value):
    return value if isinstance(value, (bool, int, float, str, type(None))) else str(value)


def _worker_init(cache: str) -> None:
    """Always compile (ptxas's log is only printed on a compile), into a scratch Triton cache."""
    from triton import knobs

    knobs.nvidia.dump_ptxas_log = True
    knobs.compilation.always_compile = True
    knobs.cache.dir = cache


def record_all(targets, only: str = "") -> dict[int, list]:
    """The launches per target, recorded once per kind of target the launch code tells apart
    (kernels/gpu_target.py: FP8 in hardware, wgmma / tcgen05)."""
    from gpu_check_launches import record_launches

    from dsaserve.kernels.gpu_target import as_target, fp8_in_hardware, has_wgmma

    def kind(cc: int) -> tuple[bool, bool]:
        with as_target(cc // 10, cc % 10):
            return fp8_in_hardware(CPU), has_wgmma(CPU)

    recorded: dict[tuple[bool, bool], list] = {}
    for cc in targets:
        if kind(cc) not in recorded:
            recorded[kind(cc)] = record_launches(cc, only)
    return {cc: recorded[kind(cc)] for cc in targets}


def compile_all(launches: dict[int, list], cache: Path, workers: int) -> list[dict]:
    """One result per (distinct specialisation, target), with the labels of its launches."""
    jobs, labels, memo = {}, defaultdict(list), {}
    for cc, recorded in launches.items():
        for launch in recorded:
            key = spec_key(launch.kernel, launch.args, launch.kwargs, cc, memo)
            labels[key].append(launch.label)
            jobs.setdefault(key, (launch.kernel.module, launch.kernel.fn.__name__,
                                  launch.args, launch.kwargs, cc))  # fmt: skip
    cache.mkdir(parents=True, exist_ok=True)
    results = {k: json.loads((cache / f"{k}.json").read_text()) for k in jobs
               if (cache / f"{k}.json").is_file()}  # fmt: skip
    todo = [k for k in jobs if k not in results]
    if todo:
        with tempfile.TemporaryDirectory() as scratch, ProcessPoolExecutor(
            workers, mp_context=get_context("spawn"), initializer=_worker_init,
            initargs=(scratch,),
        ) as pool:  # fmt: skip
            for key, result in zip(todo, pool.map(compile_one, [jobs[k] for k in todo])):
                (cache / f"{key}.json").write_text(json.dumps(result) + "\n")
                results[key] = result
    return [{**results[k], "key": k, "cached": k not in todo, "launches": len(labels[k]),
             "labels": labels[k][:3]} for k in jobs]  # fmt: skip


def dumps(report: dict, results: list[dict]) -> str:
    """The report as JSON with one line a summary row and a result (diffable, not huge)."""
    head = ",\n".join(f" {json.dumps(k)}: {json.dumps(v)}" for k, v in report.items()
                      if k != "summary")  # fmt: skip
    rows = ",\n".join(f"  {json.dumps(r)}" for r in report["summary"])
    lines = ",\n".join(f"  {json.dumps(r)}" for r in results)
    return f'{{\n{head},\n "summary": [\n{rows}\n ],\n "results": [\n{lines}\n ]\n}}\n'


def _compact(result: dict) -> dict:
    """A result as the report keeps it: pointer arguments' dtypes only, two launch labels."""
    pointers = {k: v for k, v in result["signature"].items() if v.startswith("*")}
    return {**result, "signature": pointers, "labels": result["labels"][:2],
            "expected": expected_family(result)}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Ahead-of-time compile report of our kernels")
    parser.add_argument("--targets", type=int, nargs="+", default=list(TARGETS))
    parser.add_argument("--out", default="gpu_compile.json")
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE / "dsaserve-compile-check")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--only", default="", help="claims whose name contains this")
    parser.add_argument("--detail", action="store_true", help="a row per kernel configuration")
    args = parser.parse_args(argv)
    if not set(args.targets) <= set(SHARED_LIMIT):
        parser.error(f"--targets: one of {sorted(SHARED_LIMIT)} (compute capability x 10)")
    started = time.perf_counter()
    launches = record_all(args.targets, args.only)
    results = compile_all(launches, args.cache, args.workers)
    rows = summary(results)
    print(table(detail(results) if args.detail else rows))
    wall = time.perf_counter() - started
    fresh = sum(not r["cached"] for r in results)
    count = sum(len(v) for v in {id(v): v for v in launches.values()}.values())  # once each
    print(f"{count} launches, {len(results)} compiles ({fresh} not cached), {wall:.0f} s")
    failing = [line for r in results for line in problems(r)]
    print("\n".join(["FAIL " + line for line in failing] or ["every configuration passes"]))
    report = {"triton": triton.__version__, "targets": args.targets, "wall_s": wall,
              "launches": count, "failing": failing, "summary": rows}  # fmt: skip
    Path(args.out).write_text(dumps(report, [_compact(r) for r in results]))
    return 1 if failing else 0


if __name__ == "__main__":
    raise SystemExit(main())
