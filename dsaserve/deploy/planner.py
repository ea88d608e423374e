"""The planner: a `PlanRequest` in, a checked `Plan` (or a `Refusal` and a nearest plan) out."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from dsaserve.deploy.checks import CHECKS, MEMORY_RULES
from dsaserve.deploy.commands import Command, router_command, serve_commands
from dsaserve.deploy.fit import MemoryReport, memory_report
from dsaserve.deploy.hardware import HARDWARE, get_hardware
from dsaserve.deploy.layout import RECIPES, AppliedRule, Layout, PlanRequest, Refusal
from dsaserve.deploy.models import BUILTIN_MODELS, load_model
from dsaserve.deploy.rule_list import apply_rules
from dsaserve.deploy.rules import GUIDE_RULES

AUTO_NODES = (1, 2, 4)
RULES = [*GUIDE_RULES, *CHECKS]  # the order they run in


@dataclass(frozen=True)
class Plan:
    """A layout that passed every rule, its commands and its memory-fit report."""

    request: PlanRequest
    layout: Layout | None  # None for the router role, which loads no model
    memory: MemoryReport | None
    commands: list[Command]

    @property
    def rules(self) -> list[AppliedRule]:
        return self.layout.applied if self.layout else []

    def to_json(self) -> dict[str, Any]:
        lay = self.layout
        out: dict[str, Any] = {"ok": True, "request": dataclasses.asdict(self.request)}
        if lay is not None:
            out["layout"] = {
                "model": lay.model.name, "model_path": lay.model.model_path,
                "precision": lay.model.precision, "hardware": lay.hardware.name,
                "nodes": lay.nodes, "gpus_per_node": lay.hardware.gpus_per_node,
                "tp": lay.tp, "dp": lay.dp, "ep": lay.ep, "dp_attention": lay.dp_attention,
                "moe_a2a_backend": lay.moe_a2a_backend, "kv_cache_dtype": lay.kv_dtype,
                "speculative": lay.speculative.describe() if lay.speculative else None,
                "mem_fraction_static": lay.mem_fraction,
            }  # fmt: skip
        out["memory"] = self.memory.to_json() if self.memory else None
        out["commands"] = [c._asdict() for c in self.commands]
        out["rules"] = [r._asdict() for r in self.rules]
        return out


def plan(request: PlanRequest) -> Plan:
    """Plan `request`, trying 1, 2 then 4 nodes when `--nodes` is not given and memory is short.

    Raises `Refusal` (naming the rule) when no layout works; `PlanError` for unusable input.
    """
    if request.pd == "router":
        return Plan(request, None, None, [router_command(request.port)])
    model = load_model(request.model, request.model_path)
    hardware = get_hardware(request.hardware, request.device_memory_gib)
    first_refusal = None
    for nodes in (request.nodes,) if request.nodes else AUTO_NODES:
        try:
            layout = apply_rules(Layout(request, model, hardware, nodes), RULES)
        except Refusal as refusal:
            if first_refusal is None:
                first_refusal = refusal
            elif refusal.rule not in MEMORY_RULES:  # name what blocks the bigger layout too
                more = f"; on {nodes} nodes: [{refusal.rule}] {refusal.reason}"
                raise Refusal(first_refusal.rule, first_refusal.reason + more) from None
            if refusal.rule not in MEMORY_RULES:
                break
            continue
        return _finish(request, layout)
    raise first_refusal  # type: ignore[misc]  # set: the loop runs at least once


def _finish(request: PlanRequest, layout: Layout) -> Plan:
    commands = serve_commands(layout)
    if request.pd in ("prefill", "decode"):
        commands.append(router_command(request.port))
    return Plan(request, layout, memory_report(layout), commands)


def _alternatives(request: PlanRequest) -> Iterator[PlanRequest]:
    """Requests one step away, nearest first: more nodes, fewer options, another recipe,
    another precision of the same model, another hardware."""
    if request.nodes:
        yield from (request.replace(nodes=n) for n in AUTO_NODES if n > request.nodes)
    simpler = {"speculative": "auto", "context_parallel": None, "kv_cache_dtype": "auto"}
    for key, value in simpler.items():
        if getattr(request, key) != value:
            yield request.replace(**{key: value})
    basic = request.replace(**simpler)
    yield from (basic.replace(recipe=r) for r in RECIPES if r != request.recipe)
    if request.pd == "decode":
        yield request.replace(pd=None)
    if request.model in BUILTIN_MODELS:
        family = [name for name in BUILTIN_MODELS if name[:3] == request.model[:3]]
        yield from (basic.replace(model=n, nodes=None) for n in family if n != request.model)
    for name, hw in HARDWARE.items():
        if name != request.hardware.upper() and not hw.is_cpu:
            yield basic.replace(hardware=name, nodes=None, device_memory_gib=None)


def nearest(request: PlanRequest) -> Plan | None:
    """The first alternative to a refused request that plans, or None."""
    for candidate in _alternatives(request):
        try:
            return plan(candidate)
        except Refusal:
            continue
    return None
