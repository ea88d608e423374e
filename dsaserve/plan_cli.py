"""`dsaserve plan`: hardware x precision x recipe -> a checked launch command and a memory fit.

Exit status: 0 planned, 1 refused (the reason and the nearest layout that works are printed),
2 unusable input.
"""

from __future__ import annotations

import argparse
import json
import sys

from dsaserve.deploy import layout
from dsaserve.deploy.api import plan_answer
from dsaserve.deploy.hardware import HARDWARE, PlanError
from dsaserve.deploy.layout import PlanRequest, Refusal
from dsaserve.deploy.models import BUILTIN_MODELS
from dsaserve.deploy.planner import nearest, plan
from dsaserve.deploy.render import render_plan, render_refusal


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dsaserve plan", description=__doc__, allow_abbrev=False)
    a = p.add_argument
    a("--model", default="GLM-5.3", help=f"{', '.join(BUILTIN_MODELS)}, or a checkpoint folder")
    a("--hardware", default="H200", type=str.upper, choices=list(HARDWARE.keys()))
    a("--recipe", default="low-latency", choices=layout.RECIPES)
    a("--nodes", type=int, help="nodes (default: the fewest that fit, trying 1, 2, 4)")
    a("--pd", choices=layout.PD_ROLES, help="PD disaggregation role to plan")
    a("--pd-transfer-backend", default="auto", choices=layout.PD_TRANSFER_BACKENDS,
      help="KV transfer engine of a PD worker")  # fmt: skip
    a("--hicache", action="store_true", help="add a host-memory KV tier (HiCache)")
    a("--hicache-write-policy", default="write_through", choices=layout.HICACHE_WRITE_POLICIES)
    a("--hicache-storage", choices=layout.HICACHE_STORAGE, help="HiCache storage backend")
    a("--context-parallel", nargs="?", const="interleave", choices=layout.CP_STRATEGIES,
      help="DSA prefill context parallelism (interleave)")  # fmt: skip
    a("--dp-attention", default="auto", choices=layout.DP_ATTENTION,
      help="override the recipe's DP attention")  # fmt: skip
    a("--no-reasoning-parser", dest="reasoning_parser", action="store_false")
    a("--no-tool-call-parser", dest="tool_call_parser", action="store_false")
    a("--speculative", default="auto", choices=layout.SPECULATIVE)
    a("--draft-model", help="--speculative dflash2: the DFlash drafter (default: the model's)")
    a("--kv-cache-dtype", default="auto", choices=layout.KV_DTYPES)
    a("--input-len", type=int, default=8192, help="tokens a request brings")
    a("--output-len", type=int, default=1024, help="tokens a request generates")
    a("--mem-fraction-static", type=float, help="override the rule's starting value")
    a("--device-memory-gib", type=float, help="override the hardware's memory (GiB)")
    a("--model-path", help="path to print in the commands (default: the model's)")
    a("--host", help="in the commands (0.0.0.0); with --web, where to listen (127.0.0.1)")
    a("--port", type=int, help="in the commands (30000); with --web, where to listen (8080)")
    a("--json", action="store_true", help="print one JSON object (what POST /api/plan answers)")
    a("--web", action="store_true", help="serve the web console's Deploy panel (no model)")
    return p


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    if ns.web:
        from dsaserve.server.console_standalone import serve_console

        return serve_console(ns.host or "127.0.0.1", 8080 if ns.port is None else ns.port)
    fields = {k: v for k, v in vars(ns).items() if k not in ("json", "web")}
    fields = {k: v for k, v in fields.items() if not (k in ("host", "port") and v is None)}
    if ns.json:
        answer = plan_answer(fields)
        if answer.exit_code == 2:
            print(f"error: {answer.body['error']['message']}", file=sys.stderr)
        print(json.dumps(answer.body, indent=2))
        return answer.exit_code
    try:
        request = PlanRequest(**fields)
        result = plan(request)
    except PlanError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except Refusal as refusal:
        print(render_refusal(request, refusal, nearest(request)), file=sys.stderr, end="")
        return 1
    print(render_plan(result), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
