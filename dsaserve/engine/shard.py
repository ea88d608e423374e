"""One rank's shard: its device, its slice of the model (FP8 kept where a kernel runs it) and its
KV pool. Every rank builds it with `build_shard`: the leader's `Engine` and each follower rank
(runtime/follower.py) alike, so their model slices and pool layouts agree by construction (the
pool's page count is agreed over the ranks: the smallest wins)."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from dsaserve.args import ServerArgs, speculative_settings
from dsaserve.distributed.parallel_state import ParallelState
from dsaserve.engine.kvcache.pool import KVPool
from dsaserve.engine.kvcache.sizing import build_pool
from dsaserve.engine.startup import default_threads, pick_device, pick_dtype, release_free_heap
from dsaserve.kernels.registry import Kernels, choose_kernels
from dsaserve.layers.fp8_experts import expert_bytes
from dsaserve.model_config import ModelConfig
from dsaserve.models.dsa_moe import DsaMoeForCausalLM
from dsaserve.models.fp8_keep import KeptFp8, RankReport, keep_fp8_weights, rank_reports
from dsaserve.models.load_targets import held_bytes
from dsaserve.models.loader import load_checkpoint


@dataclass
class Shard:
    """What `build_shard` gives a rank: the choices it made and what it loaded."""

    config: ModelConfig
    device: torch.device
    dtype: torch.dtype  # the compute dtype
    kernels: Kernels
    spec_steps: int  # MTP draft steps (0: no speculation, no MTP layer loaded)
    model: DsaMoeForCausalLM
    pool: KVPool
    kv_bytes_per_token: int
    fp8_kept: KeptFp8 = field(default_factory=KeptFp8)
    fp8_ranks: list[RankReport] = field(default_factory=list)  # every rank's, FP8 checkpoints
    routed_expert_bytes: int = 0  # this rank's routed experts, as held

    @property
    def with_mtp(self) -> bool:
        return self.spec_steps > 0


def build_shard(args: ServerArgs, parallel: ParallelState, show_progress: bool = True,
                own_threads: bool = False) -> Shard:  # fmt: skip
    """This rank's shard. With more than one rank it is a collective (the FP8 reports and the
    pool's page count are gathered): every rank of the layout calls it once, in step.
    `own_threads`: this process takes its torch threads from --threads (a one-rank engine;
    every rank of several takes them in runtime/ranks.py `rank_threads`)."""
    device = rank_device(args.device, parallel)
    own_threads = own_threads and parallel.world == 1  # ranks: runtime/ranks.py rank_threads
    if own_threads and device.type == "cpu":  # default: OMP_NUM_THREADS, else the cores
        torch.set_num_threads(default_threads(args.threads))
    elif own_threads and args.threads is not None:
        torch.set_num_threads(args.threads)
    config = ModelConfig.from_hf(args.model_path, json.loads(args.json_model_override_args or "{}"))
    dtype = pick_dtype(args.dtype, config, device)
    kernels = choose_kernels(args, device.type)
    spec = speculative_settings(args)
    steps = spec[0] if spec else 0
    kept = KeptFp8()

    def keep_fp8(model: nn.Module) -> None:  # this rank's slice kept FP8 (kernels/registry.py)
        nonlocal kept
        kept = keep_fp8_weights(model, config.quantization, kernels.names, kernels,
                                args.model_path)  # fmt: skip

    model = load_model(args, config, dtype, device, steps > 0, parallel, show_progress,
                       before_load=keep_fp8)  # fmt: skip
    reports = rank_reports(model, parallel, kept) if config.quantization == "fp8" else []
    pool, per_token = build_pool(args, config, steps > 0, dtype, device, parallel)
    release_free_heap()  # the loader's temporaries
    return Shard(config, device, dtype, kernels, steps, model, pool, per_token, kept, reports,
                 expert_bytes(model))  # fmt: skip


def rank_device(name: str, parallel: ParallelState) -> torch.device:
    """--device, and with several CUDA ranks this rank's GPU (set when it joined)."""
    device = pick_device(name)
    if parallel.world > 1 and device.type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return device


def load_model(args: ServerArgs, config: ModelConfig, dtype: torch.dtype, device: torch.device,
               with_mtp: bool, parallel: ParallelState, show_progress: bool = True,
               before_load: Callable[[nn.Module], object] | None = None,
               ) -> DsaMoeForCausalLM:  # fmt: skip
    """This rank's model (all of it in a single process), loaded and on `device`;
    `before_load` may swap modules first (FP8 Linears kept FP8)."""
    model = meta_model(config, with_mtp, parallel)
    if before_load is not None:
        before_load(model)
    load_checkpoint(model, args.model_path, dtype, show_progress=show_progress)
    model.to(device).eval().requires_grad_(False)
    model.rotary.inv_freq = model.rotary.inv_freq.to(device)
    return model


def meta_model(config: ModelConfig, with_mtp: bool, parallel: ParallelState) -> DsaMoeForCausalLM:
    """This rank's model with no storage yet (the loader allocates each tensor as it fills it)."""
    with torch.device("meta"):
        return DsaMoeForCausalLM(config, with_mtp=with_mtp, parallel=parallel)


def held_weight_bytes(args: ServerArgs, parallel: ParallelState, device: torch.device) -> int:
    """The bytes of this rank's weights once loaded, in the dtypes the loader keeps (FP8 kept
    where a kernel runs it, as `build_shard` decides), counted on a meta model: no weight file
    is opened (runtime/memory_fit.py checks the fit with it before anything loads)."""
    config = ModelConfig.from_hf(args.model_path, json.loads(args.json_model_override_args or "{}"))
    dtype = pick_dtype(args.dtype, config, device)
    kernels = choose_kernels(args, device.type)
    spec = speculative_settings(args)
    model = meta_model(config, bool(spec and spec[0]), parallel)
    keep_fp8_weights(model, config.quantization, kernels.names, kernels, args.model_path)
    return held_bytes(model, dtype)
