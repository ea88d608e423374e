"""What a spawned rank runs: the rank loop over its model shard, or another group's engine.

A follower (any rank but its attention group's first) loads its shard and a KV pool of the
agreed size, then joins every round until STOP. Under DP attention the first rank of groups
1..dp-1 is a full engine (scheduler, KV pool, radix cache) with its own request socket.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from dsaserve.engine.rounds import RankRunner
from dsaserve.runtime.ranks import Endpoint, init_rank, rank_threads


def run_rank(args: Any, rank: int, where: Endpoint, extra: Any) -> int:
    from dsaserve.engine.startup import pick_device

    device = pick_device(args.device)
    parallel = init_rank(args, rank, where, device.type)
    rank_threads(parallel.sizes)
    if parallel.is_leader:  # another DP-attention group's scheduler
        from dsaserve.runtime.engine_process import run_group_leader

        return run_group_leader(args, extra, parallel)
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    runner = follower_runner(args, parallel, device)
    runner.follow()
    return 0


def follower_runner(args: Any, parallel: Any, device: torch.device) -> RankRunner:
    from dsaserve.args import speculative_settings
    from dsaserve.engine.kv_pool import KVPool
    from dsaserve.engine.startup import layer_split, load_model, pick_dtype, pool_pages
    from dsaserve.kernels.kv_quant import resolve_kv_dtype
    from dsaserve.kernels.registry import choose_kernels
    from dsaserve.model_config import ModelConfig
    from dsaserve.models.dsa_moe import index_cache_ids
    from dsaserve.models.fp8_keep import KeptFp8, keep_fp8_weights, rank_reports

    config = ModelConfig.from_hf(args.model_path, json.loads(args.json_model_override_args or "{}"))
    dtype = pick_dtype(args.dtype, config, device)
    spec = speculative_settings(args)
    with_mtp = bool(spec) and spec[0] > 0
    kernels = choose_kernels(args, device.type)
    kept = KeptFp8()

    def keep(model: torch.nn.Module) -> None:  # this rank's slice kept FP8, as the leader's
        nonlocal kept
        kept = keep_fp8_weights(model, config.quantization, kernels.names, kernels,
                                args.model_path)  # fmt: skip

    model = load_model(args, config, dtype, device, with_mtp, parallel, show_progress=False,
                       before_load=keep)  # fmt: skip
    if config.quantization == "fp8":  # the leader's engine gathers every rank's report
        rank_reports(model, parallel, kept)
    stored = resolve_kv_dtype(args.kv_cache_dtype, dtype, device)  # the leader's pool layout
    pages = pool_pages(args, config, with_mtp, stored, device, parallel)
    index_layers = len(index_cache_ids(config, with_mtp))
    pool = KVPool(config, pages, args.page_size or 64, index_layers, with_mtp, stored, device,
                  fp8=stored == torch.uint8, split=layer_split(args, parallel))  # fmt: skip
    return RankRunner(model, pool.kv_cache, pool.index_cache, parallel, device)
