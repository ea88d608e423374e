"""Structured outputs' cost in the engine: a request with a grammar waits here while it
compiles (off the step, grammar/compiler.py), and the rows a step samples get their bitmask
filled on a second thread while the model runs (grammar/bitmask.py). A request that thinks first
also waits for its reasoning parser's exits over this vocabulary (grammar/thinking.py), built
once per set of exits on the compile thread."""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, NamedTuple

from dsaserve.engine.request import Req
from dsaserve.engine.scheduler import ScheduledBatch
from dsaserve.grammar.backend import make_backend
from dsaserve.grammar.bitmask import fill_bitmask
from dsaserve.grammar.compiler import GrammarCompiler, PendingGrammars
from dsaserve.grammar.state import GrammarState
from dsaserve.grammar.thinking import ThinkingExits, token_bytes


class Prepared(NamedTuple):
    grammar: Any  # the backend's compiled grammar
    exits: ThinkingExits | None  # thinking's exits, when the request thinks first


class GrammarGate:
    """`compiler` is None under `--grammar-backend none`."""

    def __init__(self, name: str, tokenizer, vocab: int, stops: list[int]) -> None:
        factory = lambda: make_backend(name, tokenizer, vocab, stops)  # noqa: E731
        self.compiler = None if name == "none" else GrammarCompiler(factory)
        self.tokenizer = tokenizer
        self.vocab = vocab
        self._token_bytes: list[bytes] | None = None
        self._exits: dict[tuple, ThinkingExits] = {}
        self.pending = PendingGrammars()  # requests whose grammar is being compiled
        self._mask_pool = ThreadPoolExecutor(1, thread_name_prefix="bitmask")

    def __len__(self) -> int:
        return len(self.pending)

    def submit(self, req: Req) -> None:
        key = (tuple(req.params.grammar_think_exits), req.params.grammar_after_token_id)
        thinks = bool(key[0]) and key[1] is not None
        compiled = self.compiler.submit(*req.params.grammar)
        self.pending.add(req, self.compiler.then(compiled, lambda grammar: Prepared(
            grammar, self.exits(key) if thinks else None)))  # fmt: skip

    def exits(self, key: tuple) -> ThinkingExits:
        """(exit tags, trigger) -> their ThinkingExits (on the compile thread: it reads the
        vocabulary once)."""
        if key not in self._exits:
            if self._token_bytes is None:
                self._token_bytes = token_bytes(self.tokenizer, self.vocab)
            self._exits[key] = ThinkingExits(self._token_bytes, list(key[0]), key[1])
        return self._exits[key]

    def resolve(self) -> tuple[list[Req], list[Req]]:
        """(requests whose grammar is ready, now holding its matcher; those whose grammar
        failed, their `error` set)."""
        resolved = self.pending.resolve()
        for req, prepared in resolved.ready:
            matcher = self.compiler.matcher(prepared.grammar)
            req.sampling.grammar = GrammarState(matcher, req.params.grammar_after_token_id,
                                                prepared.exits)  # fmt: skip
        for req, message in resolved.failed:
            req.error = f"{req.params.grammar[0]}: {message}"
        return [req for req, _ in resolved.ready], [req for req, _ in resolved.failed]

    def fill_ahead(self, scheduled: ScheduledBatch) -> Future | None:
        """Fill the grammar bitmask of the rows this step samples while the model runs."""
        states = [r.sampling for r, end in zip(scheduled.reqs, scheduled.ends)
                  if end == r.fill_len]  # fmt: skip
        if not any(s.grammar is not None and s.grammar.active for s in states):
            return None
        return self._mask_pool.submit(fill_bitmask, states, self.vocab)
