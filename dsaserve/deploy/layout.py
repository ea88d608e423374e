"""What the planner is asked (`PlanRequest`) and the layout the rules build (`Layout`)."""

from __future__ import annotations

import dataclasses
import shlex
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from dsaserve.deploy.hardware import Hardware, PlanError
from dsaserve.deploy.models import ModelSpec

RECIPES = ("low-latency", "balanced", "high-throughput")
PD_ROLES = ("prefill", "decode", "router")
SPECULATIVE = ("auto", "mtp", "none", "dflash2")
KV_DTYPES = ("auto", "bf16", "fp8_e4m3")
CP_STRATEGIES = ("interleave", "zigzag")
DP_ATTENTION = ("auto", "on", "off")  # auto: as the recipe says
PD_TRANSFER_BACKENDS = ("auto", "mooncake", "nixl")  # auto: NIXL on CPU, Mooncake on GPUs
HICACHE_WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
HICACHE_STORAGE = ("file", "mooncake", "hf3fs", "nixl")


class Refusal(Exception):
    """A plan that cannot work: the rule that refused it and why."""

    def __init__(self, rule: str, reason: str) -> None:
        super().__init__(f"[{rule}] {reason}")
        self.rule = rule
        self.reason = reason


@dataclass(frozen=True)
class PlanRequest:
    """One `dsaserve plan` invocation; `nodes=None` lets the planner pick the fewest that fit."""

    model: str = "GLM-5.3"
    hardware: str = "H200"
    recipe: str = "low-latency"
    nodes: int | None = None
    pd: str | None = None
    pd_transfer_backend: str = "auto"
    hicache: bool = False
    hicache_write_policy: str = "write_through"
    hicache_storage: str | None = None
    context_parallel: str | None = None
    dp_attention: str = "auto"
    reasoning_parser: bool = True
    tool_call_parser: bool = True
    speculative: str = "auto"
    draft_model: str | None = None  # --speculative dflash2: the drafter (default: the model's)
    kv_cache_dtype: str = "auto"
    input_len: int = 8192
    output_len: int = 1024
    mem_fraction_static: float | None = None
    device_memory_gib: float | None = None
    model_path: str | None = None
    host: str = "0.0.0.0"
    port: int = 30000

    def __post_init__(self) -> None:
        choices = {
            "recipe": RECIPES, "pd": (None, *PD_ROLES), "speculative": SPECULATIVE,
            "kv_cache_dtype": KV_DTYPES, "context_parallel": (None, *CP_STRATEGIES),
            "dp_attention": DP_ATTENTION, "pd_transfer_backend": PD_TRANSFER_BACKENDS,
            "hicache_write_policy": HICACHE_WRITE_POLICIES,
            "hicache_storage": (None, *HICACHE_STORAGE),
        }  # fmt: skip
        for name, allowed in choices.items():
            value = getattr(self, name)
            if value not in allowed:
                raise PlanError(f"--{name.replace('_', '-')} {value!r}: not one of {allowed}")
        for name in ("nodes", "input_len", "output_len", "port"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise PlanError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
        fraction = self.mem_fraction_static
        if fraction is not None and not 0 < fraction < 1:
            raise PlanError(f"--mem-fraction-static must be in (0, 1), got {fraction}")

    def replace(self, **changes: Any) -> PlanRequest:
        return dataclasses.replace(self, **changes)

    def to_argv(self) -> list[str]:
        """The `dsaserve plan` arguments that reproduce this request (defaults left out)."""
        argv = ["--model", self.model, "--hardware", self.hardware, "--recipe", self.recipe]
        defaults = PlanRequest()
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name in ("model", "hardware", "recipe") or value == getattr(defaults, f.name):
                continue
            flag = "--" + f.name.replace("_", "-")
            if value is False:  # a switch that is on by default
                argv.append("--no-" + flag[2:])
            else:
                argv += [flag] if value is True else [flag, str(value)]
        return argv

    def command(self) -> str:
        return shlex.join(["dsaserve", "plan", *self.to_argv()])


class Speculative(NamedTuple):
    algorithm: str
    num_steps: int | None = None
    eagle_topk: int | None = None
    num_draft_tokens: int | None = None
    draft_model_path: str | None = None  # DFLASH: the drafter; its block size is its own

    def describe(self) -> str:
        if self.draft_model_path is not None:
            return f"{self.algorithm} ({self.draft_model_path})"
        if self.num_steps is None:
            return self.algorithm
        return f"{self.algorithm} {self.num_steps}/{self.eagle_topk}/{self.num_draft_tokens}"


class AppliedRule(NamedTuple):
    name: str
    text: str
    detail: str


@dataclass
class Layout:
    """The plan the rules build, field by field; `flags` holds the remaining serve flags."""

    request: PlanRequest
    model: ModelSpec
    hardware: Hardware
    nodes: int
    tp: int = 1
    dp: int = 1
    ep: int = 1
    dp_attention: bool = False
    moe_a2a_backend: str | None = None
    recipe_mtp: Speculative | None = None
    speculative: Speculative | None = None
    kv_dtype: str = "bf16"
    mem_fraction: float = 0.8
    flags: dict[str, str | None] = field(default_factory=dict)
    applied: list[AppliedRule] = field(default_factory=list)

    @property
    def gpus(self) -> int:
        return self.nodes * self.hardware.gpus_per_node

    @property
    def attn_tp(self) -> int:
        """Attention-TP group size: attention weights are split this many ways."""
        return self.tp // self.dp if self.dp_attention else self.tp

    @property
    def kv_ranks(self) -> int:
        """Independent KV pools: one per DP-attention rank, one for plain TP."""
        return self.dp if self.dp_attention else 1

    @property
    def with_mtp(self) -> bool:
        return self.speculative is not None and self.speculative.algorithm == "EAGLE"

    def plain_tp(self) -> None:
        """Drop DP attention and DeepEP: attention and MoE both tensor-parallel."""
        self.dp, self.ep, self.dp_attention, self.moe_a2a_backend = 1, 1, False, None
