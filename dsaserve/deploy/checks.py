"""Fit checks run after the guide's layout rules: sizes divide, the context, the weights and
at least one request's KV fit; then balanced pins its running-request cap to the KV capacity."""

from __future__ import annotations

from dsaserve.deploy.fit import memory_report
from dsaserve.deploy.layout import Layout
from dsaserve.deploy.rule_list import Refuse, RuleList

GIB = 1 << 30
MEMORY_RULES = ("weights-fit", "kv-fits")  # refusals that more nodes can cure
CHECKS = RuleList()
rule = CHECKS.rule


@rule("layout-divides", "Heads divide by attention-TP, experts by EP, MoE width by TP.")
def _divides(lay: Layout) -> str | None:
    m = lay.model
    pairs = [
        ("attention heads", m.num_attention_heads, "attention-TP", lay.attn_tp),
        ("routed experts", m.n_routed_experts, "EP", lay.ep),
        ("moe_intermediate_size", m.moe_intermediate_size, "TP/EP", lay.tp // lay.ep),
    ]
    for what, size, by, parts in pairs:
        if size % parts:
            raise Refuse(f"{what} ({size}) do not divide by {by} {parts}")
    return None


@rule("context-fits", "Input + output tokens fit the model's context (max_position_embeddings).")
def _context(lay: Layout) -> str | None:
    tokens = lay.request.input_len + lay.request.output_len
    if tokens > lay.model.max_position_embeddings:
        limit = lay.model.max_position_embeddings
        raise Refuse(f"{tokens} tokens a request > the model's context of {limit}")
    return None


@rule("weights-fit", "Weights per GPU fit in --mem-fraction-static of device memory.")
def _weights_fit(lay: Layout) -> str:
    r = memory_report(lay)
    need, budget = r.weight_bytes_per_gpu / GIB, r.budget_bytes_per_gpu / GIB
    where = f"{lay.nodes}x{lay.hardware.gpus_per_node}x{lay.hardware.name} at TP{lay.tp}"
    if not r.weights_fit:
        raise Refuse(
            f"{r.precision.upper()} weights need {need:.1f} GiB per GPU on {where}, over the "
            f"{lay.mem_fraction} x {lay.hardware.memory_gib} GiB = {budget:.1f} GiB budget"
        )
    return f"{need:.1f} GiB of {budget:.1f} GiB per GPU"


@rule("kv-fits", "One rank's KV pool holds at least one request (input + output tokens).")
def _kv_fits(lay: Layout) -> str:
    r = memory_report(lay)
    if r.tokens_per_rank < r.tokens_per_request:
        raise Refuse(
            f"the KV pool holds {r.tokens_per_rank} tokens a rank, fewer than one request "
            f"of {r.tokens_per_request}"
        )
    return f"{r.tokens_per_rank:,} tokens a rank"


@rule(
    "balanced-max-running",
    "balanced: --max-running-requests tracks the KV capacity for the given lengths (with MTP "
    "on, the default would cap it at 48).",
)
def _balanced_max_running(lay: Layout) -> str | None:
    if lay.request.recipe != "balanced":
        return None
    concurrency = memory_report(lay).concurrency
    lay.flags["--max-running-requests"] = str(concurrency)
    return f"{concurrency} requests of {lay.request.input_len + lay.request.output_len} tokens"
