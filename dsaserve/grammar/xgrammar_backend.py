"""The xgrammar backend (SGLang's default): JSON schema, regex, EBNF and structural tags.

JSON is generated compactly (`any_whitespace=False`: `{"a": 1, "b": [2, 3]}`), so a model cannot
spend its budget on runs of whitespace, a known way for constrained decoding never to finish.

xgrammar 0.2.9 writes the characters of a length-bounded JSON string (`maxLength`/`minLength`)
as `[^"\\\r\n]`, which lets raw control characters through (invalid JSON: `json.loads` refuses
"\x1b") and encoded surrogates (three bytes that decode to three U+FFFD, so the text outgrows
its `maxLength`); `narrowed` fixes that class in every grammar with JSON in it before compiling:
a response format's schema and the JSON argument values inside a tool-call grammar.
"""

from __future__ import annotations

import json
import re
from typing import Any

import torch
import xgrammar as xgr

from dsaserve.grammar.backend import GrammarBackend, GrammarChecker, GrammarError, Matcher
from dsaserve.grammar.tool_calls import to_structural_tag

COMPILE_THREADS = 2


class XGrammarMatcher(Matcher):
    def __init__(self, compiled: xgr.CompiledGrammar) -> None:
        self._matcher = xgr.GrammarMatcher(compiled)

    def accept(self, token_id: int) -> bool:
        return self._matcher.accept_token(token_id)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def is_terminated(self) -> bool:
        return self._matcher.is_terminated()


class XGrammarBackend(GrammarBackend):
    def __init__(self, tokenizer: Any, vocab_size: int, stop_ids: list[int]) -> None:
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=stop_ids
        )
        self._compiler = xgr.GrammarCompiler(info, max_threads=COMPILE_THREADS)

    def compile(self, kind: str, source: str) -> xgr.CompiledGrammar:
        try:
            if kind == "json_schema":
                return self._compiler.compile_grammar(json_schema_grammar(source))
            if kind == "regex":
                return self._compiler.compile_regex(source)
            if kind == "ebnf":
                return self._compiler.compile_grammar(source)
            if kind == "tool_call_grammar":
                return self._compiler.compile_grammar(structural_tag_grammar(source))
        except GrammarError:
            raise
        except Exception as e:  # xgrammar raises RuntimeError / ValueError subclasses
            raise GrammarError(f"cannot compile the {kind}: {_first_line(e)}") from e
        raise GrammarError(f"unknown grammar kind {kind!r}")

    def matcher(self, compiled: xgr.CompiledGrammar) -> Matcher:
        return XGrammarMatcher(compiled)

    @staticmethod
    def checker() -> GrammarChecker:
        return XGrammarChecker()


class XGrammarChecker(GrammarChecker):
    """Builds the grammar without a tokenizer (milliseconds), which is where bad input fails."""

    def check(self, kind: str, source: str) -> None:
        try:
            if kind == "json_schema":
                json.loads(source)
                json_schema_grammar(source)
            elif kind == "regex":
                xgr.Grammar.from_regex(source)
            elif kind == "ebnf":
                xgr.Grammar.from_ebnf(source)
            elif kind == "tool_call_grammar":
                structural_tag_grammar(source)
        except GrammarError:
            raise
        except Exception as e:
            raise GrammarError(f"cannot compile the {kind}: {_first_line(e)}") from e


_LOOSE_CHARS = r"[^\"\\\r\n]"  # as xgrammar prints it
# what JSON allows unescaped in a string, less UTF-16 surrogates (their UTF-8 bytes decode to
# three U+FFFD each, which breaks maxLength)
_JSON_CHARS = r"[^\0-\x1f\"\\\uD800-\uDFFF]"


def json_schema_grammar(schema: str) -> xgr.Grammar:
    """The compact JSON grammar of a schema (with the string-class fix, see the module doc)."""
    return narrowed(xgr.Grammar.from_json_schema(schema, any_whitespace=False))


def structural_tag_grammar(source: str) -> xgr.Grammar:
    """The structural tag of a `tool_call_grammar` source (with the string-class fix)."""
    return narrowed(xgr.Grammar.from_structural_tag(json.dumps(to_structural_tag(source))))


def narrowed(grammar: xgr.Grammar) -> xgr.Grammar:
    """`grammar` with xgrammar's loose JSON string characters narrowed (see the module doc)."""
    text = str(grammar)
    return (
        xgr.Grammar.from_ebnf(text.replace(_LOOSE_CHARS, _JSON_CHARS))
        if _LOOSE_CHARS in text
        else grammar
    )


_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")  # "[07:39:29] /project/cpp/x.cc:5082: "


def _first_line(error: Exception) -> str:
    text = str(error).strip() or type(error).__name__
    return _LOG_PREFIX.sub("", text.splitlines()[0])[:300]
