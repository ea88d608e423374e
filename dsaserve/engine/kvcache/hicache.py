"""HiCache: the radix tree over three tiers (device pool, host pool, storage files).

The tree decides; the bytes move in engine/kvcache/moves.py (on this rank's tiers, and under
`--tp N` repeated by every other rank of the group on its own).

A node's `pages` are its device pages, `host_pages` its host copy. Device eviction demotes a node
to host (it stays in the tree, host-only) when it has a host copy, and drops it otherwise; the
write policy says when a node gets its host copy: `write_through` on its first hit (an insert is
one), `write_through_selective` on its second, `write_back` when it is evicted from the device.
Host eviction drops the host copy of a node still on the device, or removes a host-only leaf;
with a storage tier every host copy is also written to storage (on a background thread). A match
loads the host-only nodes of its path back to the device, then the pages its storage prefetch
read, before the scheduler hands the prefix to the request, so the prefill sees device pages
only. A page always moves as one unit: its MLA entry in every layer (the MTP layer included)
and its indexer key in every indexer layer.

Layout: host tensors mirror the device pool (`layer_first`: [layers, slots, dim]), so a move is
one gather and one scatter per tensor; `--hicache-mem-layout page_first*` is accepted and uses
the same layout (storage blobs are per page either way).
"""

from __future__ import annotations

import heapq
import time

import torch

from dsaserve.engine.kvcache.moves import HostKVPool, TierMoves
from dsaserve.engine.kvcache.pool import KVPool, PagePool
from dsaserve.engine.kvcache.radix import RadixCache, TreeNode
from dsaserve.engine.kvcache.storage import Prefetch, StorageTier

WRITE_THRESHOLD = {"write_through": 1, "write_through_selective": 2, "write_back": None}
PREFETCH_DEFAULTS = {"prefetch_threshold": 256, "prefetch_timeout_base": 1.0,
                     "prefetch_timeout_per_ki_token": 0.25}  # fmt: skip


class HiRadixCache(RadixCache):
    def __init__(self, pool: KVPool, host: HostKVPool, write_policy: str,
                 storage: StorageTier | None = None, prefetch_policy: str = "best_effort",
                 prefetch: dict | None = None, record: bool = False) -> None:  # fmt: skip
        """`record`: this is a group leader whose other ranks repeat its moves
        (engine/kvcache/moves.py)."""
        self.kv_pool, self.host = pool, host
        self.moves = TierMoves(pool, host, storage, record=record)
        self.threshold = WRITE_THRESHOLD[write_policy]
        self.write_policy = write_policy
        self.storage, self.prefetch_policy = storage, prefetch_policy
        self.prefetch_cfg = {**PREFETCH_DEFAULTS, **(prefetch or {})}
        self.prefetches: dict[str, tuple[int, Prefetch, float, int]] = {}
        self.counters = dict.fromkeys(
            ["hicache_device_hit_tokens", "hicache_host_hit_tokens", "hicache_storage_hit_tokens",
             "hicache_d2h_bytes", "hicache_h2d_bytes", "hicache_storage_load_bytes"], 0
        ) | {"hicache_h2d_seconds": 0.0, "hicache_storage_load_seconds": 0.0}  # fmt: skip
        super().__init__(pool.pages, pool.page_size, enabled=True)

    def reset(self) -> None:
        super().reset()
        host = getattr(self, "host", None)
        if host is not None:
            host.pages = PagePool(host.pages.num_pages)

    # ---- moving pages (this rank's bytes; the other ranks of its group repeat them) --------
    def _copy_d2h(self, device_pages: list[int], host_pages: list[int]) -> None:
        self.moves.d2h(device_pages, host_pages)
        self.counters["hicache_d2h_bytes"] += self._bytes(len(device_pages))

    def _bytes(self, num_pages: int) -> int:
        per_slot = self.host.kv_cache[:, :1].nbytes + self.host.index_cache[:, :1].nbytes
        return per_slot * num_pages * self.page_size

    # ---- device -> host -----------------------------------------------------------------------
    def _on_visit(self, node: TreeNode) -> None:
        node.hit_count += 1
        if self.threshold is not None and node.hit_count >= self.threshold:
            self._backup(node)

    def _backup(self, node: TreeNode) -> bool:
        """Give a device node its host copy (and storage, when on); False if host is full."""
        if node.host_pages is not None or not node.pages:
            return node.host_pages is not None
        need = len(node.pages)
        if self.host.pages.num_free < need:
            self._evict_host(need - self.host.pages.num_free)
        host_pages = self.host.pages.alloc(need)
        if host_pages is None:
            return False
        self._copy_d2h(node.pages, host_pages)
        node.host_pages = host_pages
        if self.storage is not None:
            self._write_storage(node)
        return True

    def _write_storage(self, node: TreeNode) -> None:
        tokens = self._path_tokens(node)
        keys = self.storage.codec.page_keys(tokens, self.page_size)[-len(node.host_pages) :]
        self.moves.store(node.host_pages, keys)

    def _path_tokens(self, node: TreeNode) -> list[int]:
        parts = []
        while node is not self.root:
            parts.append(node.key)
            node = node.parent
        return [t for key in reversed(parts) for t in key]

    def _adopt(self, node: TreeNode, offered: list[int]) -> list[int]:
        if node.pages:
            return super()._adopt(node, offered)
        node.pages = list(offered)  # a host-only node gets the request's device pages
        self.cached_pages += len(offered)
        if node.lock_ref == 0:
            self.evictable_pages += len(offered)
        return []

    def evict(self, num_pages: int) -> int:
        """Free device pages from unlocked nodes with no device children, LRU first: demoted to
        host when they have (or, under write_back, get) a host copy, dropped otherwise."""
        leaves = [n for n in self._nodes() if self._device_leaf(n)]
        heapq.heapify(leaves)
        freed = 0
        while freed < num_pages and leaves:
            node = heapq.heappop(leaves)
            if self.write_policy == "write_back":
                self._backup(node)
            freed += self._free_device(node)
            parent = node.parent
            if node.host_pages is None:
                self._drop_subtree(node)
            if parent is not self.root and self._device_leaf(parent):
                heapq.heappush(leaves, parent)
        return freed

    def _device_leaf(self, node: TreeNode) -> bool:
        return (
            bool(node.pages)
            and node.lock_ref == 0
            and not any(c.pages for c in node.children.values())
        )

    def _free_device(self, node: TreeNode) -> int:
        n = len(node.pages)
        self.pool.free(node.pages)
        node.pages = []
        self.evictable_pages -= n
        self.cached_pages -= n
        return n

    def _drop_subtree(self, node: TreeNode) -> None:
        """Remove a node with no device pages, and its (host-only) descendants."""
        del node.parent.children[node.key[: self.page_size]]
        stack = [node]
        while stack:
            n = stack.pop()
            stack.extend(n.children.values())
            if n.host_pages is not None:
                self.host.pages.free(n.host_pages)
                n.host_pages = None

    def _evict_host(self, num_pages: int) -> int:
        """Free host pages, LRU first: the host copy of a node still on the device, or a
        host-only leaf (already in storage when storage is on)."""
        cands = [n for n in self._nodes() if self._host_evictable(n)]
        heapq.heapify(cands)
        freed = 0
        while freed < num_pages and cands:
            node = heapq.heappop(cands)
            freed += len(node.host_pages)
            self.host.pages.free(node.host_pages)
            node.host_pages = None
            parent = node.parent
            if not node.pages:
                del parent.children[node.key[: self.page_size]]
                if parent is not self.root and self._host_evictable(parent):
                    heapq.heappush(cands, parent)
        return freed

    def _host_evictable(self, node: TreeNode) -> bool:
        if node.host_pages is None or node.lock_ref:
            return False
        return bool(node.pages) or not node.children

    # ---- host / storage -> device -------------------------------------------------------------
    def match_prefix(self, tokens: list[int], rid: str | None = None) -> tuple[list[int], TreeNode]:
        """Device pages of the longest prefix on any tier: host-only nodes and the request's
        storage prefetch are loaded to the device first."""
        loaded_before = self._loaded_tokens()
        nodes = self._match_and_load(tokens)
        prefetched = self.prefetches.pop(rid, None) if rid is not None else None
        if prefetched is not None and self._load_prefetched(tokens, nodes, prefetched):
            nodes = self._match_and_load(tokens)
        for node in nodes:
            self._on_visit(node)
        matched = sum(len(n.key) for n in nodes)
        loaded = self._loaded_tokens() - loaded_before
        self.counters["hicache_device_hit_tokens"] += max(matched - loaded, 0)
        pages = [p for node in nodes for p in node.pages]
        return pages, nodes[-1] if nodes else self.root

    def _loaded_tokens(self) -> int:
        c = self.counters
        return c["hicache_host_hit_tokens"] + c["hicache_storage_hit_tokens"]

    def _match_and_load(self, tokens: list[int]) -> list[TreeNode]:
        nodes = self._match_nodes(tokens)
        on_device = [n for n in nodes if n.pages]  # a device node's parent is on the device
        if len(on_device) < len(nodes):
            return on_device + self._load_from_host(nodes[len(on_device) :])
        return nodes

    def _load_from_host(self, host_nodes: list[TreeNode]) -> list[TreeNode]:
        """Bring host-only nodes (top-down) back to the device; the prefix of them that fit."""
        start = time.perf_counter()
        self.lock(host_nodes[-1])  # keep the path from being evicted to make room for itself
        loaded = []
        try:
            for node in host_nodes:
                pages = self._alloc_device(len(node.host_pages))
                if pages is None:
                    break
                self.moves.h2d(node.host_pages, pages)
                node.pages = pages  # locked: not evictable until unlocked
                self.cached_pages += len(pages)
                self.counters["hicache_h2d_bytes"] += self._bytes(len(pages))
                self.counters["hicache_host_hit_tokens"] += len(node.key)
                loaded.append(node)
        finally:
            self.unlock(host_nodes[-1])
        if loaded and self.kv_pool.kv_cache.is_cuda:
            torch.cuda.current_stream().synchronize()
        self.counters["hicache_h2d_seconds"] += time.perf_counter() - start
        return loaded

    def _alloc_device(self, n: int) -> list[int] | None:
        if self.pool.num_free < n:
            self.evict(n - self.pool.num_free)
        return self.pool.alloc(n)

    # ---- the storage prefetch -----------------------------------------------------------------
    def start_prefetch(self, rid: str, tokens: list[int]) -> None:
        if self.storage is None:
            return
        ps = self.page_size
        usable = (len(tokens) - 1) // ps
        cached = self._cached_pages_len(tokens, usable)
        keys = self.storage.codec.page_keys(tokens[: usable * ps], ps)[cached:]
        hits = 0
        while hits < len(keys) and self.storage.exists(keys[hits]):
            hits += 1
        if hits == 0 or hits * ps < self.prefetch_cfg["prefetch_threshold"]:
            return
        handle = self.storage.prefetch(keys[:hits])
        self.prefetches[rid] = (cached * ps, handle, time.perf_counter(), hits * ps)

    def _cached_pages_len(self, tokens: list[int], usable_pages: int) -> int:
        """Whole pages of `tokens` the tree holds on any tier (a read-only walk)."""
        node, pos, ps = self.root, 0, self.page_size
        while pos < usable_pages * ps:
            child = node.children.get(tuple(tokens[pos : pos + ps]))
            if child is None:
                break
            n = self._match_len(child.key, tokens, pos, usable_pages * ps)
            pos += n
            if n < len(child.key):
                break
            node = child
        return pos // ps

    def prefetch_ready(self, rid: str, busy: bool = False) -> bool:
        """wait_complete: when the read is done; timeout: done or past the timeout;
        best_effort: done, past the timeout, or as soon as other requests are running (it is
        then cut short rather than delay them)."""
        entry = self.prefetches.get(rid)
        if entry is None:
            return True
        _, handle, started, num_tokens = entry
        if handle.done.is_set() or self.prefetch_policy == "wait_complete":
            return handle.done.is_set()
        if self.prefetch_policy == "best_effort" and busy:
            return True
        cfg = self.prefetch_cfg
        timeout = cfg["prefetch_timeout_base"] + cfg["prefetch_timeout_per_ki_token"] * (
            num_tokens / 1024
        )
        return time.perf_counter() - started >= timeout

    def cancel_prefetch(self, rid: str) -> None:
        entry = self.prefetches.pop(rid, None)
        if entry is not None:
            entry[1].cancel()

    def _load_prefetched(self, tokens: list[int], nodes: list[TreeNode], entry) -> bool:
        """Insert the pages a prefetch read that extend the matched path, as device pages."""
        start_pos, handle, _, _ = entry
        t0 = time.perf_counter()
        pages_read = handle.cancel()
        matched = sum(len(n.key) for n in nodes)
        skip = (matched - start_pos) // self.page_size
        if matched < start_pos or skip >= len(pages_read):
            return False
        fresh = pages_read[skip:]
        if nodes:
            self.lock(nodes[-1])
        try:
            device_pages = self._alloc_device(len(fresh))
        finally:
            if nodes:
                self.unlock(nodes[-1])
        if device_pages is None:
            return False
        self.moves.load(device_pages, fresh, handle.keys[skip : skip + len(fresh)])
        end = matched + len(fresh) * self.page_size
        path_pages = [p for n in nodes for p in n.pages]
        rejected = self.insert(tokens[:end], path_pages + device_pages)
        self.pool.free(rejected)
        self.counters["hicache_storage_hit_tokens"] += len(fresh) * self.page_size
        self.counters["hicache_storage_load_bytes"] += self._bytes(len(fresh))
        self.counters["hicache_storage_load_seconds"] += time.perf_counter() - t0
        return True

    # ---- reporting and flushing ---------------------------------------------------------------
    def clear(self) -> None:
        """Drop the device and host tiers (storage persists: delete its directory to clear it)."""
        for rid in list(self.prefetches):
            self.cancel_prefetch(rid)
        for node in self._nodes():
            if node.pages:
                self.pool.free(node.pages)
        self.reset()

    def tier_stats(self) -> dict:
        host_used = self.host.pages.num_pages - self.host.pages.num_free
        stats = {"hicache_host_total_tokens": self.host.pages.num_pages * self.page_size,
                 "hicache_host_used_tokens": host_used * self.page_size,
                 "hicache_write_policy": self.write_policy, **self.counters}  # fmt: skip
        if self.storage is not None:
            stats |= self.storage.stats()
        return stats
