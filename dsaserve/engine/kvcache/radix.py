"""Radix prefix cache over whole pages, with lock counts and LRU eviction of unlocked leaves.

Keys are token runs truncated to whole pages, so a partial trailing page is never shared. A
running request locks the path of its matched prefix; finished, aborted and retracted requests
hand their computed pages to the tree, which frees duplicates and evicts on demand.

The hierarchical cache (`hicache.HiRadixCache`) subclasses this tree: a node's `pages` are its
device pages (empty once demoted), `host_pages` its copy in host memory; the hooks below
(`_adopt`, `_on_visit`, the prefetch calls) are no-ops here.
"""

from __future__ import annotations

import heapq
import itertools

from dsaserve.engine.kvcache.pool import PagePool

_clock = itertools.count()


class TreeNode:
    def __init__(self, parent: TreeNode | None, key: tuple[int, ...], pages: list[int]) -> None:
        self.parent = parent
        self.key = key
        self.pages = pages
        self.children: dict[tuple[int, ...], TreeNode] = {}
        self.lock_ref = 0
        self.last_access = next(_clock)
        self.host_pages: list[int] | None = None  # HiCache: this node's pages in host memory
        self.hit_count = 0  # HiCache write policies

    def __lt__(self, other: TreeNode) -> bool:
        return self.last_access < other.last_access


class RadixCache:
    def __init__(self, pool: PagePool, page_size: int, enabled: bool = True) -> None:
        self.pool = pool
        self.page_size = page_size
        self.enabled = enabled
        self.reset()

    def reset(self) -> None:
        self.root = TreeNode(None, (), [])
        self.root.lock_ref = 1
        self.evictable_pages = 0
        self.cached_pages = 0

    def match_prefix(self, tokens: list[int], rid: str | None = None) -> tuple[list[int], TreeNode]:
        """Pages of the longest cached whole-page prefix, leaving at least one token to compute
        (`rid`: the request matching, for tiers that prefetch on its behalf)."""
        nodes = self._match_nodes(tokens)
        pages = [p for node in nodes for p in node.pages]
        return pages, nodes[-1] if nodes else self.root

    def _match_nodes(self, tokens: list[int]) -> list[TreeNode]:
        """The nodes along the longest matched prefix (split so the last ends on the match)."""
        if not self.enabled:
            return []
        ps = self.page_size
        usable = (len(tokens) - 1) // ps * ps
        node, nodes, pos = self.root, [], 0
        while pos < usable:
            child = node.children.get(tuple(tokens[pos : pos + ps]))
            if child is None:
                break
            matched = self._match_len(child.key, tokens, pos, usable)
            if matched < len(child.key):
                child = self._split(child, matched)
            child.last_access = next(_clock)
            nodes.append(child)
            pos += matched
            node = child
        return nodes

    def _match_len(self, key: tuple[int, ...], tokens: list[int], pos: int, usable: int) -> int:
        ps, n = self.page_size, 0
        while (
            n < len(key)
            and pos + n < usable
            and key[n : n + ps] == tuple(tokens[pos + n : pos + n + ps])
        ):
            n += ps
        return n

    def _split(self, node: TreeNode, length: int) -> TreeNode:
        """Cut `node` after `length` tokens; return the new upper part."""
        upper = TreeNode(node.parent, node.key[:length], node.pages[: length // self.page_size])
        upper.lock_ref, upper.hit_count = node.lock_ref, node.hit_count
        if node.host_pages is not None:
            cut = length // self.page_size
            upper.host_pages, node.host_pages = node.host_pages[:cut], node.host_pages[cut:]
        node.parent.children[node.key[: self.page_size]] = upper
        node.key, node.pages = node.key[length:], node.pages[length // self.page_size :]
        node.parent = upper
        upper.children[node.key[: self.page_size]] = node
        return upper

    def insert(self, tokens: list[int], pages: list[int]) -> list[int]:
        """Offer whole pages of computed KV; return the offered pages the tree did not adopt
        (duplicates of cached ones), which the caller frees."""
        ps = self.page_size
        if not self.enabled:
            return list(pages)
        node, pos, rejected = self.root, 0, []
        end = len(pages) * ps
        while pos < end:
            child = node.children.get(tuple(tokens[pos : pos + ps]))
            if child is None:
                leaf = TreeNode(node, tuple(tokens[pos:end]), list(pages[pos // ps :]))
                node.children[leaf.key[:ps]] = leaf
                self.evictable_pages += len(leaf.pages)
                self.cached_pages += len(leaf.pages)
                self._on_visit(leaf)
                return rejected
            matched = self._match_len(child.key, tokens, pos, end)
            if matched < len(child.key):
                child = self._split(child, matched)
            rejected += self._adopt(child, pages[pos // ps : (pos + matched) // ps])
            child.last_access = next(_clock)
            self._on_visit(child)
            pos += matched
            node = child
        return rejected

    def _adopt(self, node: TreeNode, offered: list[int]) -> list[int]:
        """The offered pages for `node`'s tokens that the tree does not keep."""
        return [p for p, cached in zip(offered, node.pages) if p != cached]

    def _on_visit(self, node: TreeNode) -> None:
        """Called for each node an insert creates or passes through."""

    def lock(self, node: TreeNode) -> None:
        while node is not self.root:
            if node.lock_ref == 0:
                self.evictable_pages -= len(node.pages)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: TreeNode) -> None:
        while node is not self.root:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.evictable_pages += len(node.pages)
            node = node.parent

    def evict(self, num_pages: int) -> int:
        """Free at least `num_pages` pages from unlocked leaves, least recently used first."""
        leaves = [n for n in self._nodes() if not n.children and n.lock_ref == 0]
        heapq.heapify(leaves)
        freed = 0
        while freed < num_pages and leaves:
            leaf = heapq.heappop(leaves)
            self.pool.free(leaf.pages)
            freed += len(leaf.pages)
            self.evictable_pages -= len(leaf.pages)
            self.cached_pages -= len(leaf.pages)
            parent = leaf.parent
            del parent.children[leaf.key[: self.page_size]]
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(leaves, parent)
        return freed

    def clear(self) -> None:
        """Drop every cached page (no request may hold a lock)."""
        self.evict(self.pool.num_pages)
        self.reset()

    # ---- hooks for tiers below the device (HiCache); nothing to do without one ----------------
    def start_prefetch(self, rid: str, tokens: list[int]) -> None:
        """A request arrived: start fetching what a lower tier holds of its prefix."""

    def prefetch_ready(self, rid: str, busy: bool = False) -> bool:
        """Whether the request may be admitted now (its prefetch policy is satisfied)."""
        return True

    def cancel_prefetch(self, rid: str) -> None:
        """The request finished or was aborted: stop its prefetch, keep nothing of it."""

    def tier_stats(self) -> dict:
        return {}

    def _nodes(self):
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            yield node
