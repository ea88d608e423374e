"""The llguidance backend: JSON schema, regex, EBNF (GBNF, or Lark as llguidance reads it) and
tool-call grammars (the structural tag of `tool_calls` written as Lark, see `tool_calls_lark`).

JSON is compact with xgrammar's separators (`{"a": 1, "b": [2]}`, no free whitespace) for the
reason the xgrammar backend gives, so both backends write the JSON models are trained on.
"""

from __future__ import annotations

from typing import Any

import llguidance
import llguidance.hf
import llguidance.torch
import torch
from llguidance.gbnf_to_lark import any_to_lark

from dsaserve.grammar.backend import GrammarBackend, GrammarChecker, GrammarError, Matcher
from dsaserve.grammar.tool_calls_lark import JSON_STYLE, tool_call_lark

JSON_DEFAULTS = JSON_STYLE


def grammar_text(kind: str, source: str, specials: frozenset[str] = frozenset()) -> str:
    """llguidance's grammar (a JSON document) for one (kind, source); `specials`: the special
    tokens a tool-call grammar writes as tokens (none in the tokenizer-free check)."""
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
        try:
            return llguidance.LLMatcher.grammar_from_lark(tool_call_lark(source, specials))
        except GrammarError:
            raise
        except Exception as e:  # a schema or pattern llguidance cannot read
            raise GrammarError(f"cannot build the tool-call grammar: {e}") from e
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
        added = tokenizer.get_added_vocab() if hasattr(tokenizer, "get_added_vocab") else {}
        self._specials = frozenset(
            text for text, i in added.items()
            if i < vocab_size and self._tokenizer.is_special_token(i)
        )  # fmt: skip

    def compile(self, kind: str, source: str) -> str:
        grammar = grammar_text(kind, source, self._specials)
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
