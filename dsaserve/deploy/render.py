"""Human-readable output of a plan or a refusal."""

from __future__ import annotations

from dsaserve.deploy.commands import Command
from dsaserve.deploy.fit import MemoryReport
from dsaserve.deploy.layout import PlanRequest, Refusal
from dsaserve.deploy.planner import Plan

GIB = 1 << 30


def _gib(n: int) -> str:
    return f"{n / GIB:,.1f} GiB"


def render_plan(p: Plan) -> str:
    lines = [_headline(p), ""]
    for c in p.commands:
        same = [] if c.sglang == c.dsaserve else ["# the same line for SGLang:", c.sglang]
        lines += [_label(p, c), c.dsaserve, *same, ""]
    if p.memory:
        lines += _render_memory(p.memory) + [""]
    if p.rules:
        lines.append("Rules applied:")
        width = max(len(r.name) for r in p.rules)
        for r in p.rules:
            lines += [f"  {r.name:<{width}}  {r.detail}", f"  {'':<{width}}  ({r.text})"]
    return "\n".join(lines).rstrip() + "\n"


def _label(p: Plan, c: Command) -> str:
    multi_node = p.layout is not None and p.layout.nodes > 1 and c.role != "router"
    return f"# {c.role}" + (f" on node {c.node_rank}" if multi_node else "")


def _headline(p: Plan) -> str:
    lay = p.layout
    if lay is None:
        return "# PD router in front of one prefill and one decode worker"
    parallel = f"TP{lay.tp}"
    if lay.dp_attention:
        parallel += f", DP-attention DP{lay.dp}"
    if lay.ep > 1:
        parallel += f", EP{lay.ep}" + (f" ({lay.moe_a2a_backend})" if lay.moe_a2a_backend else "")
    spec = lay.speculative.describe() if lay.speculative else "no speculative decoding"
    hw = f"{lay.nodes} x {lay.hardware.gpus_per_node} x {lay.hardware.name}"
    return (
        f"# {lay.model.name} ({lay.model.precision.upper()}) on {hw}, {lay.request.recipe}: "
        f"{parallel}, {spec}, KV {lay.kv_dtype}"
    )


def _render_memory(r: MemoryReport) -> list[str]:
    mtp = f" + MTP {r.params_mtp / 1e9:.2f} B" if r.params_mtp else ""
    served = (
        f"; {r.kv_bytes_per_token_served:,} B with the MTP layer"
        if r.kv_bytes_per_token_served != r.kv_bytes_per_token
        else ""
    )
    rows = [
        ("parameters", f"{r.params_main / 1e9:.1f} B main{mtp}, {r.precision.upper()}: "
         f"{r.weight_bytes_total / 1e9:,.1f} GB of weights"),
        ("weights per GPU", f"{_gib(r.weight_bytes_per_gpu)} of {_gib(r.device_bytes)}; "
         f"--mem-fraction-static {r.mem_fraction_static} -> {_gib(r.budget_bytes_per_gpu)}"),
        ("KV pool per GPU", _gib(r.kv_pool_bytes_per_gpu)),
        ("KV per token", f"{r.kv_bytes_per_token:,} B ({r.kv_dtype}){served}"),
        ("tokens that fit", f"{r.tokens_per_rank:,} per KV pool x {r.kv_ranks} = "
         f"{r.total_tokens:,}"),
        ("concurrency", f"{r.concurrency:,} requests of {r.tokens_per_request:,} tokens"),
    ]  # fmt: skip
    if r.kv_bytes_per_token_layer_split:
        share = r.kv_bytes_per_token_layer_split / r.kv_bytes_per_token_served
        rows.append(("KV, LayerSplit", f"{r.kv_bytes_per_token_layer_split:,} B per token per "
                     f"CP rank ({share:.0%}, {r.cp_size} ranks) with "
                     "--enable-dsa-cache-layer-split (pool not sized up for it)"))  # fmt: skip
    if r.hicache_host_bytes_per_gpu:
        rows.append(("HiCache host", f"{_gib(r.hicache_host_bytes_per_gpu)} per GPU"))
    return ["Memory fit:"] + [f"  {name:<16} {value}" for name, value in rows]


def render_refusal(request: PlanRequest, refusal: Refusal, near: Plan | None) -> str:
    lines = [f"error: cannot plan this layout: [{refusal.rule}] {refusal.reason}"]
    if near is None:
        lines.append("no nearby layout works either")
    else:
        lines += ["", "nearest layout that works:", near.request.command(), ""]
        for c in near.commands:
            lines += [_label(near, c), c.dsaserve]
    return "\n".join(lines) + "\n"
