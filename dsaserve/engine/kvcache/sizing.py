"""The KV pool's size: its bytes per token, its pages from --max-total-tokens or the memory
(agreed over the ranks: the smallest wins), and the pool itself (engine/shard.py builds every
rank's with `build_pool`; runtime/memory_fit.py checks the fit with the same numbers)."""

from __future__ import annotations

import os
from functools import partial

import torch

from dsaserve.args import ServerArgs
from dsaserve.dflash_args import dflash_settings
from dsaserve.distributed.parallel_state import ParallelState
from dsaserve.engine.kvcache.pool import KVPool
from dsaserve.kernels.kv_quant import resolve_kv_dtype
from dsaserve.layers.layer_split import split_kv_cache
from dsaserve.model_config import ModelConfig
from dsaserve.models.dflash_config import DFlashConfig
from dsaserve.models.dsa_moe import index_cache_ids

CPU_MAX_TOTAL_TOKENS = 1 << 18


def build_pool(args: ServerArgs, config: ModelConfig, with_mtp: bool, dtype: torch.dtype,
               device: torch.device, parallel: ParallelState) -> tuple[KVPool, int]:  # fmt: skip
    """The KV pool (and its bytes per token): its storage dtype from --kv-cache-dtype, its
    pages from --max-total-tokens or the memory, agreed over the ranks. A token also takes a
    DFLASH drafter's context entry (engine/spec/draft.py), beside the pool."""
    stored = resolve_kv_dtype(args.kv_cache_dtype, dtype, device)
    dflash = dflash_settings(args)
    drafter = DFlashConfig.from_dir(dflash.draft_path) if dflash is not None else None
    extra = drafter.context_bytes_per_token(dtype.itemsize) if drafter is not None else 0
    pages = pool_pages(args, config, with_mtp, stored, device, parallel, extra)
    index_layers = len(index_cache_ids(config, with_mtp))
    pool = KVPool(config, pages, args.page_size or 64, index_layers, with_mtp, stored, device,
                  fp8=stored == torch.uint8, split=layer_split(args, parallel))  # fmt: skip
    return pool, pool_bytes_per_token(config, with_mtp, stored) + extra


def pool_bytes_per_token(config: ModelConfig, with_mtp: bool, stored: torch.dtype) -> int:
    """KV bytes a token takes; `stored` is the pool's dtype (uint8: the FP8 layout)."""
    return KVPool.bytes_per_token(config, len(index_cache_ids(config, with_mtp)), with_mtp,
                                  stored.itemsize, stored == torch.uint8)  # fmt: skip


def layer_split(args: ServerArgs, parallel: ParallelState):
    """The KV pool's LayerSplit hook (None unless --enable-dsa-cache-layer-split)."""
    if not args.enable_dsa_cache_layer_split:
        return None
    return partial(split_kv_cache, args, parallel)


def pool_pages(args: ServerArgs, config: ModelConfig, with_mtp: bool, stored: torch.dtype,
               device: torch.device, parallel: ParallelState,
               extra_per_token: int = 0) -> int:  # fmt: skip
    """KV pages; every rank computes it and the smallest wins, so all pools have one layout.
    `extra_per_token`: bytes a token also takes beside the pool (a DFlash drafter's context)."""
    per_token = pool_bytes_per_token(config, with_mtp, stored) + extra_per_token
    tokens = args.max_total_tokens or tokens_from_memory(args, per_token, device)
    pages = max(tokens // (args.page_size or 64), 2)
    if parallel.world > 1:
        agreed = torch.tensor([pages])
        torch.distributed.all_reduce(agreed, torch.distributed.ReduceOp.MIN,
                                     group=parallel.cpu_group)  # fmt: skip
        pages = int(agreed)
    return pages


def tokens_from_memory(args: ServerArgs, per_token: int, device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * (args.mem_fraction_static or 0.85) // per_token)
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return min(int(total * (args.mem_fraction_static or 0.05) // per_token), CPU_MAX_TOTAL_TOKENS)
