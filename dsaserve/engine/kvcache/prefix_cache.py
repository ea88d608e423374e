"""`PrefixCache`: what the scheduler and the engine ask of a prefix cache, whichever tier holds it.

Two implementations: `RadixCache` (radix.py: device pages only) and `HiRadixCache` (hicache.py:
device, host and storage tiers). `build_cache` (build.py) picks one from the flags; the
scheduler (engine/scheduler.py) and the engine see only this seam. A new tier goes behind it:
subclass `RadixCache` and override its hooks, as `HiRadixCache` does.
"""

from __future__ import annotations

from typing import Protocol

from dsaserve.engine.kvcache.radix import TreeNode


class PrefixCache(Protocol):
    evictable_pages: int  # device pages the cache would free on demand
    cached_pages: int

    def match_prefix(self, tokens: list[int], rid: str | None = None) -> tuple[list[int], TreeNode]:
        """The device pages of the longest cached whole-page prefix, and its node to lock."""

    def insert(self, tokens: list[int], pages: list[int]) -> list[int]:
        """Hand a request's computed pages to the tree; returns the duplicates it freed."""

    def lock(self, node: TreeNode) -> None: ...

    def unlock(self, node: TreeNode) -> None: ...

    def evict(self, num_pages: int) -> int:
        """Free at least `num_pages` device pages from unlocked leaves; returns how many."""

    def clear(self) -> None:
        """Forget every cached prefix (device and host tiers; a storage tier persists)."""

    def start_prefetch(self, rid: str, tokens: list[int]) -> None: ...

    def prefetch_ready(self, rid: str, busy: bool = False) -> bool: ...

    def cancel_prefetch(self, rid: str) -> None: ...

    def tier_stats(self) -> dict: ...
