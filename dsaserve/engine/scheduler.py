"""Continuous batching: each step computes one token for every decoding request plus prefill
chunks of new ones, within the token budget, the request cap and the free KV.

A request's step computes `fill_ids[kv_len : kv_len + n]` (fill = prompt + output so far); a
decode is the case n = 1. When KV runs out the newest requests are retracted: their computed
pages go to the radix cache and they wait again, resuming from prompt + output (nothing is lost).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

import torch

from dsaserve.engine.kvcache.pool import KVPool, page_slots
from dsaserve.engine.kvcache.radix import RadixCache
from dsaserve.engine.request import Req


@dataclass(frozen=True)
class SchedulerConfig:
    max_running_requests: int
    chunked_prefill_size: int  # prefill tokens per step; -1: no chunking
    context_length: int
    # KV tokens a decoding request computes per step: 1, or steps + 1 with speculation (verify)
    decode_tokens: int = 1


@dataclass
class ScheduledBatch:
    reqs: list[Req]
    starts: list[int]
    ends: list[int]
    # explicit tokens per request (speculative verify and draft runs); None: fill[start:end]
    input_ids: list[list[int]] | None = None

    @property
    def num_tokens(self) -> int:
        return sum(e - s for s, e in zip(self.starts, self.ends))


class Scheduler:
    def __init__(self, config: SchedulerConfig, pool: KVPool, cache: RadixCache) -> None:
        self.config = config
        self.pool = pool
        self.cache = cache
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.num_retractions = 0

    def add(self, req: Req) -> None:
        self.waiting.append(req)
        self.cache.start_prefetch(req.rid, req.fill_ids)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch | None:
        batch = ScheduledBatch([], [], [])
        self._schedule_decodes(batch)
        budget = self.config.chunked_prefill_size
        budget = math.inf if budget < 0 else budget
        for req in [r for r in self.running if self._remaining(r) > 1]:
            budget -= self._schedule_chunk(batch, req, budget)
        while self.waiting and budget > 0 and len(self.running) < self.config.max_running_requests:
            req = self.waiting[0]
            if not self.cache.prefetch_ready(req.rid, busy=bool(batch.reqs)):
                break
            if not self._admit(req):
                break
            self.waiting.popleft()
            self.running.append(req)
            budget -= self._schedule_chunk(batch, req, budget)
        return batch if batch.reqs else None

    def _remaining(self, req: Req) -> int:
        return len(req.prompt_ids) + len(req.output_ids) - req.kv_len

    def _schedule_decodes(self, batch: ScheduledBatch) -> None:
        for req in sorted(self.running, key=lambda r: r.order):
            if req not in self.running or self._remaining(req) != 1:
                continue
            while not self.grow(req, req.kv_len + self.config.decode_tokens):
                victim = max(self.running, key=lambda r: r.order)
                self.retract(victim)
                if victim is req:
                    break
            else:
                self._add(batch, req, req.kv_len + 1)

    def _schedule_chunk(self, batch: ScheduledBatch, req: Req, budget: float) -> int:
        """Schedule the next prefill chunk of `req`; return the tokens it takes."""
        n = int(min(self._remaining(req), budget))
        if n <= 0 or not self.grow(req, req.kv_len + n):
            return 0
        self._add(batch, req, req.kv_len + n)
        return n

    def _add(self, batch: ScheduledBatch, req: Req, end: int) -> None:
        batch.reqs.append(req)
        batch.starts.append(req.kv_len)
        batch.ends.append(end)

    def _admit(self, req: Req) -> bool:
        """Match the cached prefix and check the KV for the whole fill plus decode headroom."""
        fill = req.fill_ids
        pages, node = self.cache.match_prefix(fill, req.rid)
        needed = math.ceil(len(fill) / self.pool.page_size) - len(pages) + len(self.running)
        if self.pool.pages.num_free + self.cache.evictable_pages < needed and self.running:
            return False
        self.cache.lock(node)
        req.prefix_node, req.pages = node, list(pages)
        req.kv_len = len(pages) * self.pool.page_size
        req.slots = page_slots(req.pages, self.pool.page_size)
        if req.cached_tokens is None:
            req.cached_tokens = req.kv_len
        return True

    def grow(self, req: Req, tokens: int) -> bool:
        """Give `req` pages for `tokens` tokens, evicting cached pages if needed."""
        need = math.ceil(tokens / self.pool.page_size) - len(req.pages)
        if need <= 0:
            return True
        if self.pool.pages.num_free < need:
            self.cache.evict(need - self.pool.pages.num_free)
        new = self.pool.pages.alloc(need)
        if new is None:
            return False
        req.pages += new
        req.slots = torch.cat([req.slots, page_slots(new, self.pool.page_size)])
        return True

    def adopt(self, req: Req) -> None:
        """Run `req` from its `pages`, filled elsewhere (prefill/decode disaggregation)."""
        req.slots = page_slots(req.pages, self.pool.page_size)
        self.running.append(req)

    def release(self, req: Req) -> None:
        """Hand the request's computed whole pages to the cache and free the rest."""
        ps = self.pool.page_size
        whole = req.kv_len // ps
        rejected = self.cache.insert(req.fill_ids[: whole * ps], req.pages[:whole])
        self.pool.pages.free(rejected + req.pages[whole:])
        if req.prefix_node is not None:
            self.cache.unlock(req.prefix_node)
        req.pages, req.prefix_node, req.kv_len = [], None, 0
        req.slots = req.slots[:0]

    def retract(self, req: Req) -> None:
        self.release(req)
        self.running.remove(req)
        self.waiting.appendleft(req)
        self.num_retractions += 1

    def finish(self, req: Req) -> None:
        self.cache.cancel_prefetch(req.rid)
        self.release(req)
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
