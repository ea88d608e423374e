"""Will it fit? The weights this node's ranks will hold plus their KV pools, against the memory
they will live in, checked once at start before any weight file is opened.

The weights are counted as the loader will keep them (`engine/shard.py held_weight_bytes`: a
meta model of rank 0's slice, FP8 kept where a kernel runs it, the rest in the compute dtype;
the load's log uses the same count). The KV pool is `--max-total-tokens` tokens when given, else
what the engine would size from memory (on CPU a share of the host's; on a GPU whatever is left
after the weights, so only the weights count there). On CPU every rank of this node shares the
host's available memory (`MemAvailable`); on a GPU each rank has its own device. Over it:
`ArgsError` (exit 2) naming the bytes needed and available and a `dsaserve plan` line that fits.
`--skip-memory-check` skips it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from dsaserve.args import ArgsError, ServerArgs
from dsaserve.deploy.hardware import HARDWARE, PlanError
from dsaserve.deploy.layout import PlanRequest, Refusal
from dsaserve.deploy.models import BUILTIN_MODELS
from dsaserve.deploy.planner import Plan, nearest, plan
from dsaserve.distributed.parallel_state import ParallelSizes, ParallelState
from dsaserve.engine.kvcache.sizing import pool_bytes_per_token, tokens_from_memory
from dsaserve.engine.shard import held_weight_bytes
from dsaserve.engine.startup import pick_device, pick_dtype
from dsaserve.kernels.kv_quant import resolve_kv_dtype
from dsaserve.model_config import ConfigError, ModelConfig
from dsaserve.models.checkpoint_files import CheckpointError

GIB = 1 << 30


@dataclass(frozen=True)
class MemoryNeed:
    weights_per_rank: int
    kv_per_rank: int
    ranks: int  # ranks sharing `available` (this node's, on CPU; one per GPU)
    available: int
    where: str  # "host memory available" or "memory of GPU 0 (NVIDIA H100)"

    @property
    def needed(self) -> int:
        return self.ranks * (self.weights_per_rank + self.kv_per_rank)


def check_memory_fit(args: ServerArgs) -> str | None:
    """None when skipped, else the one-line account to print; ArgsError when it cannot fit."""
    if args.skip_memory_check or not os.path.isdir(args.model_path):
        return None  # (no folder: the tokenizer's check names it)
    try:
        need = memory_need(args)
    except (ConfigError, CheckpointError):
        return None  # a checkpoint it cannot read: the engine's start names what is wrong
    each = f"{need.weights_per_rank} weights + {need.kv_per_rank} KV pool"
    account = (f"{need.needed} bytes ({need.needed / GIB:.1f} GiB) needed ({need.ranks} rank(s) "
               f"x ({each})), {need.available} bytes ({need.available / GIB:.1f} GiB) "
               f"{need.where}")  # fmt: skip
    if need.needed <= need.available:
        return f"memory: {account}"
    raise ArgsError(f"--model-path {args.model_id or args.model_path} does not fit: {account}; "
                    f"{fitting_plan(args, need)}; --skip-memory-check starts anyway")  # fmt: skip


def memory_need(args: ServerArgs) -> MemoryNeed:
    device = pick_device(args.device)
    sizes = ParallelSizes.from_args(args)
    weights = held_weight_bytes(args, ParallelState(sizes), device)
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(0)
        kv = kv_pool_bytes(args, device) if args.max_total_tokens else 0
        return MemoryNeed(weights, kv, 1, props.total_memory, f"on GPU 0 ({props.name})")
    ranks = sizes.ranks_per_node * sizes.replicas
    return MemoryNeed(weights, kv_pool_bytes(args, device), ranks, host_available(),
                      "of host memory available")  # fmt: skip


def kv_pool_bytes(args: ServerArgs, device: torch.device) -> int:
    """One rank's KV pool as the engine will size it (engine/kvcache/sizing.py pool_pages)."""
    config = ModelConfig.from_hf(args.model_path, json.loads(args.json_model_override_args or "{}"))
    stored = resolve_kv_dtype(args.kv_cache_dtype, pick_dtype(args.dtype, config, device), device)
    per_token = pool_bytes_per_token(config, args.speculative_algorithm in ("EAGLE", "NEXTN"),
                                     stored)  # fmt: skip
    tokens = args.max_total_tokens or tokens_from_memory(args, per_token, device)
    return tokens * per_token


def host_available() -> int:
    """The kernel's estimate of memory available without swapping (MemAvailable)."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def fitting_plan(args: ServerArgs, need: MemoryNeed) -> str:
    """The `dsaserve plan` line (and its layout) that fits this checkpoint, from the planner:
    this machine's hardware first, then the planner's nearest alternative."""
    model = next((name for name, spec in BUILTIN_MODELS.items()
                  if spec.model_path == args.model_id), args.model_path)  # fmt: skip
    hardware = _hardware_name(need)
    request = PlanRequest(model=model, hardware=hardware, model_path=args.model_id,
                          device_memory_gib=round(need.available / GIB, 1))  # fmt: skip
    try:
        found: Plan | None = plan(request)
    except Refusal:
        found = nearest(request)
    except PlanError as e:
        return f"the planner cannot size it ({e})"
    if found is None or found.layout is None:
        return "the planner finds no layout that fits"
    lay = found.layout
    line = f"dsaserve plan --model {found.request.model} --hardware {found.request.hardware}"
    if found.request.device_memory_gib is not None:
        line += f" --device-memory-gib {found.request.device_memory_gib}"
    if args.model_id and found.request.model == args.model_path:  # a folder: print the id
        line += f" --model-path {args.model_id}"
    where = f"tp {lay.tp}, {lay.nodes} node(s) of {found.request.hardware}"
    return f"this fits: {line} --nodes {lay.nodes} ({where})"


def _hardware_name(need: MemoryNeed) -> str:
    if not need.where.startswith("on GPU"):
        return "CPU"
    return next((name for name in HARDWARE if name in need.where.upper()), "H200")
