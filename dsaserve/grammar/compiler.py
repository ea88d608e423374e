"""Compiling grammars off the engine step: one worker thread, a cache of futures per grammar.

The backend itself is built in the worker on first use (xgrammar reads the whole vocabulary),
so a server that never sees a grammar never pays for it. Identical grammars (same kind and
source) share one compile; failures are cached too, so a bad schema fails fast the next time.
Requests wait in `PendingGrammars` until their grammar is ready; the step never blocks on one.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from typing import Any, NamedTuple

from dsaserve.grammar.backend import GrammarBackend, GrammarError, Matcher

CACHE_SIZE = 512
COMPILE_TIMEOUT_S = 60.0


class GrammarCompiler:
    """`submit(kind, source)` -> a Future of the compiled grammar (shared per grammar)."""

    def __init__(self, make_backend: Callable[[], GrammarBackend]) -> None:
        self._make_backend = make_backend
        self._backend: GrammarBackend | None = None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar")
        self._cache: OrderedDict[tuple[str, str], Future] = OrderedDict()

    def submit(self, kind: str, source: str) -> Future:
        key = (kind, source)
        if key in self._cache:
            self._cache.move_to_end(key)
            return self._cache[key]
        future = self._pool.submit(self._compile, kind, source)
        self._cache[key] = future
        while len(self._cache) > CACHE_SIZE:
            self._cache.popitem(last=False)
        return future

    def then(self, compiled: Future, step: Callable[[Any], Any]) -> Future:
        """`step(grammar)` on the compile thread once `compiled` is done (it was queued first on
        the one worker, so it is done by then); its failure fails the result too."""
        return self._pool.submit(lambda: step(compiled.result()))

    def matcher(self, compiled: Any) -> Matcher:
        assert self._backend is not None  # a compile has run
        return self._backend.matcher(compiled)

    def _compile(self, kind: str, source: str) -> Any:
        if self._backend is None:
            self._backend = self._make_backend()
        return self._backend.compile(kind, source)


class Resolved(NamedTuple):
    ready: list[tuple[Any, Any]]  # (item, compiled grammar)
    failed: list[tuple[Any, str]]  # (item, error message)


class PendingGrammars:
    """Items (requests) waiting for their grammar; `resolve()` hands back those that are done."""

    def __init__(self) -> None:
        self._items: dict[int, tuple[Any, Future, float]] = {}

    def __len__(self) -> int:
        return len(self._items)

    def add(self, item: Any, future: Future) -> None:
        self._items[id(item)] = (item, future, time.monotonic())

    def discard(self, item: Any) -> None:
        self._items.pop(id(item), None)

    def wait(self, timeout: float) -> None:
        """Block up to `timeout` seconds for one compile (when nothing else is runnable)."""
        if self._items:
            futures = [f for _, f, _ in self._items.values()]
            wait_futures(futures, timeout=timeout, return_when="FIRST_COMPLETED")

    def resolve(self) -> Resolved:
        out = Resolved([], [])
        now = time.monotonic()
        for key, (item, future, since) in list(self._items.items()):
            if future.done():
                del self._items[key]
                error = future.exception()
                if error is None:
                    out.ready.append((item, future.result()))
                else:
                    message = str(error) if isinstance(error, GrammarError) else repr(error)
                    out.failed.append((item, message))
            elif now - since > COMPILE_TIMEOUT_S:
                del self._items[key]
                out.failed.append((item, f"compiling the grammar took over {COMPILE_TIMEOUT_S}s"))
        return out
