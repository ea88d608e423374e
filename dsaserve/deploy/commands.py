"""Turn a finished `Layout` into launch commands, with flags named as SGLang names them."""

from __future__ import annotations

import re
import shlex
from typing import NamedTuple

from dsaserve.deploy.layout import Layout

# the order flags are printed in; every flag a rule may set must be listed here
FLAG_ORDER = [
    "--model-path", "--tp", "--dp", "--ep", "--enable-dp-attention", "--moe-a2a-backend",
    "--reasoning-parser", "--tool-call-parser", "--speculative-algorithm",
    "--speculative-num-steps", "--speculative-eagle-topk", "--speculative-num-draft-tokens",
    "--speculative-draft-model-path",
    "--kv-cache-dtype", "--dsa-prefill-backend", "--dsa-decode-backend", "--enable-prefill-cp",
    "--cp-strategy", "--attn-cp-size", "--chunked-prefill-size", "--max-running-requests",
    "--mem-fraction-static",
    "--watchdog-timeout", "--enable-hierarchical-cache", "--hicache-ratio",
    "--hicache-write-policy", "--hicache-storage-backend",
    "--disaggregation-mode", "--disaggregation-transfer-backend",
    "--disaggregation-bootstrap-port", "--device", "--nnodes", "--node-rank", "--dist-init-addr",
    "--host", "--port",
]  # fmt: skip
_PLAIN = re.compile(r"[\w@%+=:,./${}-]+")  # left unquoted, so ${VAR} stays expandable
DIST_INIT_PORT = 5000
ROUTER_PORT = 8000
BOOTSTRAP_PORT = 8998  # SGLang's default --disaggregation-bootstrap-port


class Command(NamedTuple):
    """One process to start: who runs it, and the same arguments for dsaserve and SGLang."""

    role: str  # "serve", "prefill", "decode" or "router"
    node_rank: int
    dsaserve: str
    sglang: str


def serve_flags(lay: Layout) -> dict[str, str | None]:
    """Every `serve` flag of the layout (None marks a switch), before multi-node flags."""
    m, spec = lay.model, lay.speculative
    flags: dict[str, str | None] = {"--model-path": m.model_path, "--tp": str(lay.tp)}
    if lay.dp_attention:
        flags.update({"--dp": str(lay.dp), "--enable-dp-attention": None})
    if lay.ep > 1:
        flags["--ep"] = str(lay.ep)
    if lay.moe_a2a_backend:
        flags["--moe-a2a-backend"] = lay.moe_a2a_backend
    if lay.request.reasoning_parser:
        flags["--reasoning-parser"] = m.reasoning_parser
    if lay.request.tool_call_parser:
        flags["--tool-call-parser"] = m.tool_call_parser
    if spec:
        flags["--speculative-algorithm"] = spec.algorithm
        for name in ("num_steps", "eagle_topk", "num_draft_tokens", "draft_model_path"):
            if getattr(spec, name) is not None:
                flags["--speculative-" + name.replace("_", "-")] = str(getattr(spec, name))
    if not lay.hardware.is_cpu:
        flags["--mem-fraction-static"] = str(lay.mem_fraction)
    flags.update(lay.flags)
    flags.update({"--host": lay.request.host, "--port": str(lay.request.port)})
    return flags


def shell_join(argv: list[str]) -> str:
    """Join for a shell, quoting only what needs it (`${NODE0_IP}` stays a variable)."""
    return " ".join(arg if _PLAIN.fullmatch(arg) else shlex.quote(arg) for arg in argv)


def _argv(flags: dict[str, str | None]) -> list[str]:
    unknown = set(flags) - set(FLAG_ORDER)
    if unknown:
        raise ValueError(f"flags missing from FLAG_ORDER: {sorted(unknown)}")
    argv: list[str] = []
    for flag in sorted(flags, key=FLAG_ORDER.index):
        argv += [flag] if flags[flag] is None else [flag, flags[flag]]
    return argv


def serve_commands(lay: Layout) -> list[Command]:
    """One command per node (`--nnodes/--node-rank/--dist-init-addr` when more than one)."""
    role = lay.request.pd or "serve"
    commands = []
    for rank in range(lay.nodes):
        flags = serve_flags(lay)
        if lay.nodes > 1:
            flags["--nnodes"], flags["--node-rank"] = str(lay.nodes), str(rank)
            flags["--dist-init-addr"] = f"${{NODE0_IP}}:{DIST_INIT_PORT}"
        args = shell_join(_argv(flags))
        commands.append(Command(role, rank, f"dsaserve serve {args}", f"sglang serve {args}"))
    return commands


def router_command(port: int) -> Command:
    """sglang-router in PD mode in front of one prefill (with its bootstrap port) and one decode
    (hosts as shell variables). dsaserve ships no router of its own: the same command fronts
    dsaserve and SGLang workers."""
    args = [
        "--pd-disaggregation",
        "--prefill", f"http://${{PREFILL_HOST}}:{port}", str(BOOTSTRAP_PORT),
        "--decode", f"http://${{DECODE_HOST}}:{port}",
        "--host", "0.0.0.0", "--port", str(ROUTER_PORT),
    ]  # fmt: skip
    text = f"python -m sglang_router.launch_router {shell_join(args)}"
    return Command("router", 0, text, text)
