"""`dsaserve plan`: hardware x precision x recipe -> a checked launch command and a memory fit.

Exit status: 0 planned, 1 refused (the reason and the nearest layout that works are printed),
2 unusable input.
"""

from __future__ import annotations

import argparse
import json
import sys

from dsaserve.deploy.hardware import HARDWARE, PlanError
from dsaserve.deploy.layout import (
    CP_STRATEGIES,
    KV_DTYPES,
    PD_ROLES,
    RECIPES,
    SPECULATIVE,
    PlanRequest,
    Refusal,
)
from dsaserve.deploy.models import BUILTIN_MODELS
from dsaserve.deploy.planner import nearest, plan
from dsaserve.deploy.report import render_plan, render_refusal


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dsaserve plan", description=__doc__, allow_abbrev=False)
    a = p.add_argument
    a("--model", default="GLM-5.3", help=f"{', '.join(BUILTIN_MODELS)}, or a checkpoint folder")
    a("--hardware", default="H200", type=str.upper, choices=list(HARDWARE.keys()))
    a("--recipe", default="low-latency", choices=RECIPES)
    a("--nodes", type=int, help="nodes (default: the fewest that fit, trying 1, 2, 4)")
    a("--pd", choices=PD_ROLES, help="PD disaggregation role to plan")
    a("--hicache", action="store_true", help="add a host-memory KV tier (HiCache)")
    a("--context-parallel", nargs="?", const="interleave", choices=CP_STRATEGIES,
      help="DSA prefill context parallelism (interleave)")  # fmt: skip
    a("--speculative", default="auto", choices=SPECULATIVE)
    a("--kv-cache-dtype", default="auto", choices=KV_DTYPES)
    a("--input-len", type=int, default=8192, help="tokens a request brings")
    a("--output-len", type=int, default=1024, help="tokens a request generates")
    a("--mem-fraction-static", type=float, help="override the rule's starting value")
    a("--device-memory-gib", type=float, help="override the hardware's memory (GiB)")
    a("--model-path", help="path to print in the commands (default: the model's)")
    a("--host", default="0.0.0.0")
    a("--port", type=int, default=30000)
    a("--json", action="store_true", help="print one JSON object")
    return p


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    as_json = ns.json
    fields = {k: v for k, v in vars(ns).items() if k != "json"}
    try:
        request = PlanRequest(**fields)
        result = plan(request)
    except PlanError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except Refusal as refusal:
        near = nearest(request)
        if as_json:
            out = {"ok": False, "rule": refusal.rule, "reason": refusal.reason}
            out["nearest"] = {"plan": near.request.command(), **near.to_json()} if near else None
            print(json.dumps(out, indent=2))
        else:
            print(render_refusal(request, refusal, near), file=sys.stderr, end="")
        return 1
    print(json.dumps(result.to_json(), indent=2) if as_json else render_plan(result), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
