"""Tool-call grammars for llguidance: the structural tag of `tool_calls`, written as Lark.

`tool_calls.to_structural_tag` describes a tool-call grammar as a tree (const strings, regexes,
JSON schemas, sequences, optional parts, tags, tags with a separator, triggered tags); xgrammar
compiles that tree itself, llguidance gets it node by node as a Lark grammar, so both backends
constrain the same format:

- Markup that is one special token of the tokenizer (GLM's `<tool_call>`, `<arg_key>`, …) is
  written `<tool_call>`: in llguidance a special token never matches its text, and the model
  writes these as the special token. Other text (the tool name, DSML's markup where it is plain
  text) is a string literal.
- A JSON value is `%json` allowing at most one whitespace character in a row, as the xgrammar
  tag does (`JSON_WHITESPACE`).
- A regex is a `/…/` terminal (JSON-schema regex semantics: `\\d` is ASCII); the UTF-16
  surrogate range of `raw_string_regex` is dropped (llguidance's regexes match Unicode scalar
  values, which never include surrogates). The free-argument regexes of non-strict tools hold
  markup, so they become rules.
- Triggered tags (`tool_choice` "auto" with a strict tool): free text, then a call once the
  trigger appears. A special-token trigger ends the text by itself; a text trigger is a lazy
  lexeme (text up to the first occurrence), and the text after the last call cannot hold it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection
from typing import Any

from llguidance import regex_to_lark

from dsaserve.grammar.backend import GrammarError
from dsaserve.grammar.tool_calls import DSML, DSML_FREE_ARGS, FREE_ARGS, to_structural_tag

JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# argument values: at most one whitespace character in a row, as xgrammar's max_whitespace_cnt
ARGUMENT_STYLE = {"whitespace_flexible": True, "whitespace_pattern": "[ \\n\\t]?"}
ANY_TEXT = r"(.|\n)*"
_SURROGATES = "\\uD800-\\uDFFF"


def tool_call_lark(source: str, specials: Collection[str]) -> str:
    """The Lark grammar of a `tool_call_grammar` source; `specials`: the tokenizer's special
    tokens (empty in the tokenizer-free check: everything is then text, same structure)."""
    return LarkWriter(specials).grammar(to_structural_tag(source)["format"])


class LarkWriter:
    """Writes one grammar: `start` plus the helper rules its nodes need."""

    def __init__(self, specials: Collection[str]) -> None:
        self.specials = set(specials)
        self.rules: list[str] = []

    def grammar(self, node: dict) -> str:
        start = self.node(node)
        return "\n".join(["%llguidance {}", f"start: {start}", *self.rules]) + "\n"

    def rule(self, body: str, lazy: bool = False, terminal: bool = False) -> str:
        name = f"{'T' if terminal else 'r'}{len(self.rules)}"
        self.rules.append(f"{name}{'[lazy]' if lazy else ''}: {body}")
        return name

    def node(self, node: dict) -> str:
        kind = node["type"]
        if kind == "const_string":
            return self.text(node["value"])
        if kind == "regex":
            return self.regex(node["pattern"])
        if kind == "json_schema":
            return json_value(node["json_schema"])
        if kind == "sequence":
            return " ".join(self.node(n) for n in node["elements"]) or '""'
        if kind == "optional":
            return f"({self.node(node['content'])})?"
        if kind == "tag":
            return self.tag(node)
        if kind == "tags_with_separator":
            if node.get("separator"):
                raise GrammarError("tool-call separators are not supported by llguidance")
            calls = self.rule(" | ".join(self.tag(t) for t in node["tags"]))
            return calls if node.get("stop_after_first") else f"{calls}+"
        if kind == "triggered_tags":
            return self.triggered(node)
        raise GrammarError(f"cannot write a {kind!r} tool-call node for llguidance")

    def tag(self, node: dict) -> str:
        return f"{self.text(node['begin'])} {self.node(node['content'])} {self.text(node['end'])}"

    def triggered(self, node: dict) -> str:
        (trigger,) = node["triggers"]
        rests = []
        for tag in node["tags"]:
            if not tag["begin"].startswith(trigger):
                raise GrammarError("a triggered tag must begin with its trigger")
            rest = dict(tag, begin=tag["begin"][len(trigger) :])
            rests.append(self.tag(rest))
        calls = self.rule(" | ".join(rests))
        if trigger in self.specials:
            text = self.rule(f"/{ANY_TEXT}/", terminal=True)
            call, last = self.rule(f"{text} {self.text(trigger)} {calls}"), text
        else:
            lead = self.rule(f"/{ANY_TEXT}/ {json.dumps(trigger, ensure_ascii=False)}", lazy=True)
            call = self.rule(f"{lead} {calls}")
            banned = regex_to_lark(f"{ANY_TEXT}{re.escape(trigger)}{ANY_TEXT}", "")
            last = self.rule(f"/{ANY_TEXT}/ & ~/{banned}/", terminal=True)
        if node.get("stop_after_first"):
            return f"{last} | {call}"
        return f"{call}* {last}"

    def text(self, value: str) -> str:
        """A string as special tokens and literals, in order."""
        if not value:
            return '""'
        found = sorted((s for s in self.specials if s in value), key=len, reverse=True)
        if not found:
            return json.dumps(value, ensure_ascii=False)
        pieces = re.split("(" + "|".join(map(re.escape, found)) + ")", value)
        return " ".join(p if p in self.specials else json.dumps(p, ensure_ascii=False)
                        for p in pieces if p)  # fmt: skip

    def regex(self, pattern: str) -> str:
        if pattern == FREE_ARGS:
            pair = (f"{self.text('<arg_key>')} /[^<]{{1,64}}/ {self.text('</arg_key>')} "
                    f"{self.text('<arg_value>')} /[^<]*/ {self.text('</arg_value>')}")  # fmt: skip
            return f"({pair})*"
        if pattern == DSML_FREE_ARGS:
            param = (f'{self.text(f"<{DSML}parameter name=")} /"[^"<]{{1,64}}"/ '
                     f'{self.text(" string=")} /"(true|false)"/ {self.text(">")} /[^<]*/ '
                     f"{self.text(f'</{DSML}parameter>')} {self.text(chr(10))}")  # fmt: skip
            return f"({param})*"
        return "/" + regex_to_lark(pattern.replace(_SURROGATES, ""), "dw") + "/"


def json_value(schema: Any) -> str:
    """`%json` of an argument's schema (a boolean schema as an object)."""
    if schema is True or schema is None:
        schema = {}
    if not isinstance(schema, dict):
        raise GrammarError(f"an argument schema must be an object, not {schema!r}")
    return "%json " + json.dumps(schema | {"x-guidance": ARGUMENT_STYLE}, ensure_ascii=False)
