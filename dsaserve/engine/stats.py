"""The engine's report (`/get_server_info`'s `internal_states`, `/metrics`, the bench tools):
requests, KV pool and radix cache use, the kernels and FP8 weights chosen, and the counters."""

from __future__ import annotations

from typing import Any

import torch


def report(engine: Any) -> dict:
    """`engine`: an `Engine` (engine/engine.py, which calls this for its `stats()`)."""
    pool, cache, shard = engine.pool, engine.cache, engine.shard
    used_pages = pool.pages.num_pages - pool.pages.num_free - cache.evictable_pages
    prompt = engine.stats_counters["prompt_tokens"]
    return {
        "num_running": len(engine.scheduler.running),
        "num_waiting": len(engine.scheduler.waiting),
        "kv_total_tokens": pool.num_tokens,
        "kv_used_tokens": used_pages * pool.page_size,
        "kv_cached_tokens": cache.cached_pages * pool.page_size,
        "kv_free_pages": pool.pages.num_free,
        "kv_cache_dtype": engine.kv_dtype,
        "kv_bytes_per_token": shard.kv_bytes_per_token,
        "kernel_backends": dict(engine.kernels.names),
        "cpu_threads": torch.get_num_threads(),
        "decode_path": decode_path(engine),
        # with ranks (the leader's DistributedModel): each rank's path for all-decode steps
        # (native only where every rank's is), and the rounds that ran it
        "rank_decode_paths": getattr(engine.model, "rank_paths", None) or [decode_path(engine)],
        "native_rank_rounds": getattr(engine.model, "native_rounds", 0),
        "fp8_linears_kept": shard.fp8_kept.linears,
        "fp8_expert_layers_kept": shard.fp8_kept.expert_layers,
        "routed_expert_bytes": shard.routed_expert_bytes,
        "fp8_ranks": [rank.summary() for rank in engine.fp8_ranks],
        "cuda_graph": engine.graphs.stats() if engine.graphs is not None else None,
        "cache_hit_rate": engine.stats_counters["cached_tokens"] / prompt if prompt else 0.0,
        "num_retractions": engine.scheduler.num_retractions,
        **engine.stats_counters,
        **(engine.spec.report.stats() if engine.spec is not None else {}),
        **cache.tier_stats(),
    }


def decode_path(engine: Any) -> str:
    """Which forward an all-decode step takes (engine/decode/paths.py): native, python (fused),
    compiled or layered; a CUDA graph replays it where a bucket fits."""
    return next(path.name for path in engine.runner.paths if path.name != "cuda_graph")
