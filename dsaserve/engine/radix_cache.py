"""Radix prefix cache over whole pages, with lock counts and LRU eviction of unlocked leaves.

Keys are token runs truncated to whole pages, so a partial trailing page is never shared. A
running request locks the path of its matched prefix; finished, aborted and retracted requests
hand their computed pages to the tree, which frees duplicates and evicts on demand.
"""

from __future__ import annotations

import heapq
import itertools

from dsaserve.engine.kv_pool import PagePool

_clock = itertools.count()


class TreeNode:
    def __init__(self, parent: TreeNode | None, key: tuple[int, ...], pages: list[int]) -> None:
        self.parent = parent
        self.key = key
        self.pages = pages
        self.children: dict[tuple[int, ...], TreeNode] = {}
        self.lock_ref = 0
        self.last_access = next(_clock)

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

    def match_prefix(self, tokens: list[int]) -> tuple[list[int], TreeNode]:
        """Pages of the longest cached whole-page prefix, leaving at least one token to compute."""
        if not self.enabled:
            return [], self.root
        ps = self.page_size
        usable = (len(tokens) - 1) // ps * ps
        node, pages, pos = self.root, [], 0
        while pos < usable:
            child = node.children.get(tuple(tokens[pos : pos + ps]))
            if child is None:
                break
            matched = self._match_len(child.key, tokens, pos, usable)
            if matched < len(child.key):
                child = self._split(child, matched)
            child.last_access = next(_clock)
            pages += child.pages
            pos += matched
            node = child
        return pages, node

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
        upper.lock_ref = node.lock_ref
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
                return rejected
            matched = self._match_len(child.key, tokens, pos, end)
            if matched < len(child.key):
                child = self._split(child, matched)
            mine = pages[pos // ps : (pos + matched) // ps]
            rejected += [p for p, cached in zip(mine, child.pages) if p != cached]
            child.last_access = next(_clock)
            pos += matched
            node = child
        return rejected

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

    def _nodes(self):
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            yield node
