"""The prefix cache the flags ask for (`build_cache`): the radix cache, or with
`--enable-hierarchical-cache` and the `--hicache-*` flags the hierarchical one: the host pool's
size, the storage tier's backend and the identity its files carry, the prefetch settings
(hicache.py is the tree itself). Every rank of a group builds its own tiers here: the leader
under its tree (`build_hicache`), the others bare (`build_rank_tiers`)."""

from __future__ import annotations

import json
import logging
import secrets

import torch

from dsaserve.args import ServerArgs
from dsaserve.cluster.secret import cluster_secret
from dsaserve.distributed.parallel_state import ParallelState
from dsaserve.engine.kvcache.codec import PageCodec, storage_key
from dsaserve.engine.kvcache.hicache import PREFETCH_DEFAULTS, HiRadixCache
from dsaserve.engine.kvcache.moves import HostKVPool, TierMoves
from dsaserve.engine.kvcache.pool import KVPool
from dsaserve.engine.kvcache.prefix_cache import PrefixCache
from dsaserve.engine.kvcache.radix import RadixCache
from dsaserve.engine.kvcache.storage import (
    StorageTier,
    make_backend,
    model_identity,
    private_dir,
    storage_root,
)

logger = logging.getLogger(__name__)


def build_cache(args: ServerArgs, pool: KVPool, dtype: torch.dtype, with_mtp: bool,
                parallel: ParallelState) -> PrefixCache:  # fmt: skip
    """The leader's prefix cache: radix (off with --disable-radix-cache), or hierarchical."""
    if not args.enable_hierarchical_cache:
        return RadixCache(pool.pages, pool.page_size, enabled=not args.disable_radix_cache)
    return build_hicache(args, pool, dtype, with_mtp, parallel)


def build_hicache(args: ServerArgs, pool: KVPool, dtype: torch.dtype, with_mtp: bool,
                  parallel: ParallelState | None = None) -> HiRadixCache:  # fmt: skip
    """The hierarchical cache the flags ask for (over the radix cache: args.py refuses
    --disable-radix-cache with it), on this group leader's tiers."""
    parallel = parallel or ParallelState.single()
    host = build_host(args, pool)
    storage = build_storage(args, pool, dtype, with_mtp, parallel)
    extra = json.loads(args.hicache_storage_backend_extra_config or "{}")
    logger.info("HiCache: host pool %d tokens (%.1f MiB), write policy %s, storage %s",
                host.pages.num_pages * pool.page_size,
                (host.kv_cache.nbytes + host.index_cache.nbytes) / 2**20,
                args.hicache_write_policy, args.hicache_storage_backend or "off")  # fmt: skip
    prefetch = {k: float(extra[k]) for k in PREFETCH_DEFAULTS if k in extra}
    return HiRadixCache(pool, host, args.hicache_write_policy, storage,
                        args.hicache_storage_prefetch_policy, prefetch,
                        record=parallel.attn_tp > 1)  # fmt: skip


def build_rank_tiers(args: ServerArgs, pool: KVPool, dtype: torch.dtype, with_mtp: bool,
                     parallel: ParallelState) -> TierMoves:  # fmt: skip
    """A follower's own host and storage tiers, sized as its leader's (the pools agree), where
    it repeats the leader's moves."""
    storage = build_storage(args, pool, dtype, with_mtp, parallel)
    return TierMoves(pool, build_host(args, pool), storage, leader_keys=True)


def build_host(args: ServerArgs, pool: KVPool) -> HostKVPool:
    """--hicache-ratio x the device pool's pages, or --hicache-size GB."""
    ratio_pages = int(pool.pages.num_pages * args.hicache_ratio)
    if args.hicache_size:
        per_page = (pool.kv_cache.nbytes + pool.index_cache.nbytes) // pool.pages.num_pages
        ratio_pages = int(args.hicache_size * 2**30 // per_page)
    return HostKVPool(pool, max(ratio_pages, 1))


def build_storage(args: ServerArgs, pool: KVPool, dtype: torch.dtype, with_mtp: bool,
                  parallel: ParallelState) -> StorageTier | None:  # fmt: skip
    """This rank's storage tier. Its identity names the checkpoint, the KV layout and, with
    several ranks, the layout of the ranks and this rank's place: every rank reads only the
    files it wrote (engine/kvcache/moves.py)."""
    if not args.hicache_storage_backend:
        return None
    extra = json.loads(args.hicache_storage_backend_extra_config or "{}")
    parts = {"dtype": str(dtype), "kv_cache_dtype": args.kv_cache_dtype, "page_size":
             pool.page_size, "kv_shape": list(pool.kv_cache.shape[::2]), "index_shape":
             list(pool.index_cache.shape[::2]), "with_mtp": with_mtp, "tp_size": args.tp_size,
             "format": "layer_first-v1"}  # fmt: skip
    if parallel.world > 1:
        sizes = parallel.sizes
        parts |= {"ep_size": sizes.ep, "dp_size": sizes.dp, "dp_attention": sizes.dp_attention,
                  "attn_tp_size": sizes.attn_tp, "attn_tp_rank": parallel.attn_rank}  # fmt: skip
    identity = model_identity(args.model_path, parts)
    kv_shape = (pool.kv_cache.shape[0], pool.page_size, pool.kv_cache.shape[2])
    index_shape = (pool.index_cache.shape[0], pool.page_size, pool.index_cache.shape[2])
    codec = PageCodec(identity, kv_shape, index_shape, pool.kv_cache.dtype,
                      page_key(args, extra))  # fmt: skip
    return StorageTier(make_backend(args.hicache_storage_backend, extra, identity[:16]), codec)


def page_key(args: ServerArgs, extra: dict) -> bytes:
    """The deployment's key for storage pages (codec.py); an unusable storage directory
    gets a key for this run only (its pages do not outlive it)."""
    root = storage_root(extra)
    try:
        private_dir(root)
        return storage_key(cluster_secret(args), root)
    except OSError as e:
        logger.warning("HiCache storage: no key file in %s (%s); pages written now are not "
                       "readable after a restart", root, e)  # fmt: skip
        return secrets.token_bytes(32)
