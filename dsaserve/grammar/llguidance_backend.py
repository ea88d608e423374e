"""The llguidance backend: JSON schema, regex and EBNF (GBNF, or Lark as llguidance reads it).

JSON is compact (`whitespace_flexible: false`) for the reason the xgrammar backend gives. Tool-call
grammars are built as xgrammar structural tags only, so with `--grammar-backend llguidance`
a forced or strict tool call is refused (400) rather than left unconstrained.
"""

from __future__ import annotations

from typing import Any

import llguidance
import llguidance.hf
import llguidance.torch
import torch
from llguidance.gbnf_to_lark import any_to_lark

from dsaserve.grammar.backend import GrammarBackend, GrammarChecker, GrammarError, Matcher

JSON_DEFAULTS = {"whitespace_flexible": False}


def grammar_text(kind: str, source: str) -> str:
    """llguidance's grammar (a JSON document) for one (kind, source)."""
    if kind == "json_schema":
        return llguidance.LLMatcher.grammar_from_json_schema(source, defaults=JSON_DEFAULTS)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(source)
    if kind == "ebnf":
        try:
            return llguidance.LLMatcher.grammar_from_lark(any_to_lark(source))
        except Exception as e:  # GbnfToLarkError and friends
            raise GrammarError(f"cannot read the ebnf: {e}") from e
    if kind == "tool_call_grammar":
        raise GrammarError("tool-call grammars need --grammar-backend xgrammar")
    raise GrammarError(f"unknown grammar kind {kind!r}")


class LLGuidanceMatcher(Matcher):
    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self._matcher = matcher

    def accept(self, token_id: int) -> bool:
        return self._matcher.consume_token(token_id)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        llguidance.torch.fill_next_token_bitmask(self._matcher, bitmask, row)

    def is_terminated(self) -> bool:
        return self._matcher.is_stopped()


class LLGuidanceBackend(GrammarBackend):
    def __init__(self, tokenizer: Any, vocab_size: int, stop_ids: list[int]) -> None:
        eos = stop_ids[0] if stop_ids else None
        self._tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos)

    def compile(self, kind: str, source: str) -> str:
        grammar = grammar_text(kind, source)
        error = llguidance.LLMatcher.validate_grammar(grammar, self._tokenizer)
        if error:
            raise GrammarError(f"cannot compile the {kind}: {error.strip().splitlines()[0]}")
        return grammar  # llguidance builds its parser lazily, per matcher

    def matcher(self, compiled: str) -> Matcher:
        return LLGuidanceMatcher(llguidance.LLMatcher(self._tokenizer, compiled))

    @staticmethod
    def checker() -> GrammarChecker:
        return LLGuidanceChecker()


class LLGuidanceChecker(GrammarChecker):
    def check(self, kind: str, source: str) -> None:
        error = llguidance.LLMatcher.validate_grammar(grammar_text(kind, source), None)
        if error:
            raise GrammarError(f"cannot compile the {kind}: {error.strip().splitlines()[0]}")
