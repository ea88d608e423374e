"""Structured outputs' cost in the engine: a request with a grammar waits here while it
compiles (off the step, grammar/compiler.py), and the rows a step samples get their bitmask
filled on a second thread while the model runs (grammar/bitmask.py)."""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

from dsaserve.engine.request import Req
from dsaserve.engine.scheduler import ScheduledBatch
from dsaserve.grammar.backend import make_backend
from dsaserve.grammar.bitmask import fill_bitmask
from dsaserve.grammar.compiler import GrammarCompiler, PendingGrammars
from dsaserve.grammar.state import GrammarState


class GrammarGate:
    """`compiler` is None under `--grammar-backend none`."""

    def __init__(self, name: str, tokenizer, vocab: int, stops: list[int]) -> None:
        factory = lambda: make_backend(name, tokenizer, vocab, stops)  # noqa: E731
        self.compiler = None if name == "none" else GrammarCompiler(factory)
        self.vocab = vocab
        self.pending = PendingGrammars()  # requests whose grammar is being compiled
        self._mask_pool = ThreadPoolExecutor(1, thread_name_prefix="bitmask")

    def __len__(self) -> int:
        return len(self.pending)

    def submit(self, req: Req) -> None:
        self.pending.add(req, self.compiler.submit(*req.params.grammar))

    def resolve(self) -> tuple[list[Req], list[Req]]:
        """(requests whose grammar is ready, now holding its matcher; those whose grammar
        failed, their `error` set)."""
        resolved = self.pending.resolve()
        for req, compiled in resolved.ready:
            matcher = self.compiler.matcher(compiled)
            req.sampling.grammar = GrammarState(matcher, req.params.grammar_after_token_id)
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
