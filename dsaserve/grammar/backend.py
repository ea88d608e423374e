"""The grammar-backend seam: compile a grammar for a tokenizer, then match one request with it.

A backend turns a (kind, source) pair into a compiled grammar; kinds are `json_schema` (JSON
text), `regex`, `ebnf` (xgrammar's GBNF-style EBNF; llguidance reads the same text as GBNF or
Lark) and `tool_call_grammar` (see `tool_calls`). Matchers speak one bitmask format (int32 words,
bit j of word w allows token 32 w + j), so both backends share the masking code in `bitmask`.
Backends are imported lazily: `--grammar-backend none` needs neither package.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from typing import Any

import torch

BACKENDS = {
    "xgrammar": "dsaserve.grammar.xgrammar_backend:XGrammarBackend",
    "llguidance": "dsaserve.grammar.llguidance_backend:LLGuidanceBackend",
}


class GrammarError(ValueError):
    """A grammar the backend cannot compile; the message says why."""


class Matcher(ABC):
    """One request's position in its grammar."""

    @abstractmethod
    def accept(self, token_id: int) -> bool:
        """Advance by one token; False (and no change) when the grammar forbids it."""

    @abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into row `row` of an int32 [B, ceil(V / 32)] bitmask."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """True once the grammar is complete and a stop token has been accepted."""

    def fill_rows(self, matchers: list[Matcher], bitmask: torch.Tensor) -> None:
        """Fill rows 0.. of `bitmask` for `matchers` (all of this one's type). The seam for a
        parallel fill: xgrammar's BatchGrammarMatcher measured slower than this loop on 2 cores
        (bench/structured.py --fill-vocab), so neither backend overrides it yet."""
        for row, matcher in enumerate(matchers):
            matcher.fill_bitmask(bitmask, row)


class GrammarBackend(ABC):
    """Compiles grammars for one tokenizer and makes matchers from them."""

    @abstractmethod
    def compile(self, kind: str, source: str) -> Any:
        """The compiled grammar (thread-safe; may take a while). Raises GrammarError."""

    @abstractmethod
    def matcher(self, compiled: Any) -> Matcher: ...


class GrammarChecker(ABC):
    """Tokenizer-free validation in the API process, so a bad schema is a 400 before any work."""

    @abstractmethod
    def check(self, kind: str, source: str) -> None:
        """Raise GrammarError when `source` is not a grammar of `kind` this backend accepts."""


def make_backend(name: str, tokenizer: Any, vocab_size: int, stop_ids: list[int]) -> GrammarBackend:
    return _load(name)(tokenizer, vocab_size, stop_ids)


def make_checker(name: str) -> GrammarChecker:
    return _load(name).checker()


def _load(name: str) -> Any:
    if name not in BACKENDS:
        raise ValueError(f"unknown grammar backend {name!r}; choose from {sorted(BACKENDS)}")
    module, attr = BACKENDS[name].split(":")
    return getattr(importlib.import_module(module), attr)
