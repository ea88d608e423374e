"""The hierarchical cache that `--enable-hierarchical-cache` and the `--hicache-*` flags ask
for: the host pool's size, the storage tier's backend and the identity its files carry, the
prefetch settings (engine/hicache.py is the tree itself)."""

from __future__ import annotations

import json
import logging

import torch

from dsaserve.args import ServerArgs
from dsaserve.engine.hicache import PREFETCH_DEFAULTS, HiRadixCache, HostKVPool
from dsaserve.engine.hicache_storage import PageCodec, StorageTier, make_backend, model_identity
from dsaserve.engine.kv_pool import KVPool

logger = logging.getLogger(__name__)


def build_hicache(
    args: ServerArgs, pool: KVPool, dtype: torch.dtype, with_mtp: bool
) -> HiRadixCache:
    """The hierarchical cache the flags ask for (over the radix cache: args.py refuses
    --disable-radix-cache with it)."""
    device_bytes = pool.kv_cache.nbytes + pool.index_cache.nbytes
    ratio_pages = int(pool.pages.num_pages * args.hicache_ratio)
    if args.hicache_size:
        per_page = device_bytes // pool.pages.num_pages
        ratio_pages = int(args.hicache_size * 2**30 // per_page)
    host = HostKVPool(pool, max(ratio_pages, 1))
    storage, extra = None, json.loads(args.hicache_storage_backend_extra_config or "{}")
    if args.hicache_storage_backend:
        parts = {"dtype": str(dtype), "kv_cache_dtype": args.kv_cache_dtype, "page_size":
                 pool.page_size, "kv_shape": list(pool.kv_cache.shape[::2]), "index_shape":
                 list(pool.index_cache.shape[::2]), "with_mtp": with_mtp, "tp_size": args.tp_size,
                 "format": "layer_first-v1"}  # fmt: skip
        identity = model_identity(args.model_path, parts)
        kv_shape = (pool.kv_cache.shape[0], pool.page_size, pool.kv_cache.shape[2])
        index_shape = (pool.index_cache.shape[0], pool.page_size, pool.index_cache.shape[2])
        codec = PageCodec(identity, kv_shape, index_shape, pool.kv_cache.dtype)
        backend = make_backend(args.hicache_storage_backend, extra, identity[:16])
        storage = StorageTier(backend, codec)
    logger.info("HiCache: host pool %d tokens (%.1f MiB), write policy %s, storage %s",
                host.pages.num_pages * pool.page_size,
                (host.kv_cache.nbytes + host.index_cache.nbytes) / 2**20,
                args.hicache_write_policy, args.hicache_storage_backend or "off")  # fmt: skip
    prefetch = {k: float(extra[k]) for k in PREFETCH_DEFAULTS if k in extra}
    return HiRadixCache(pool, host, args.hicache_write_policy, storage,
                        args.hicache_storage_prefetch_policy, prefetch)  # fmt: skip
