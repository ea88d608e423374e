"""Structured output in the API process: request fields -> grammar sampling fields, checked.

Chat: OpenAI `response_format` (`json_object`, `json_schema`), SGLang's `regex` / `ebnf` /
`json_schema`, and tool-call grammars for `tool_choice` "required" or a named tool and for tools
marked `strict` (in the model's own format, see `dsaserve.grammar.tool_calls`). When the prompt
opens reasoning (`<think>`) and a reasoning parser splits it off, the grammar starts after
`</think>`: thinking stays free (but cannot end the answer, nor end anywhere the parser and the
grammar would disagree on) and the answer in `content` is constrained. `/generate` and
`/v1/completions` take `regex`, `ebnf` and `json_schema` as given, from the first token.

Every grammar is built once here by the backend without a tokenizer (milliseconds), so a schema
it cannot compile is a 400 naming the field before the engine sees the request.
"""

from __future__ import annotations

import json
from typing import Any

from dsaserve.grammar import tool_calls
from dsaserve.grammar.backend import GrammarChecker, GrammarError, make_checker
from dsaserve.sampling_params import GRAMMAR_FIELDS
from dsaserve.server.parsers.choice import REASONING_PARSERS
from dsaserve.server.parsers.reasoning import THINK_END
from dsaserve.web.errors import bad_request

JSON_OBJECT = '{"type": "object"}'
SCHEMA_PARAM = "response_format.json_schema.schema"


class StructuredOutput:
    """Turns a request's structured-output fields into checked SamplingParams fields."""

    def __init__(self, backend: str, vocab: dict[str, int]) -> None:
        self.backend = backend
        self.think_end = vocab.get("</think>")
        self._checker: GrammarChecker | None = None  # imported on first use

    def chat_fields(self, req: Any, tools: list[dict], tool_choice: Any, parser: str | None,
                    prompt: str, reasoning: str | None = None) -> dict:  # fmt: skip
        """Sampling fields for a chat request (`req`: ChatCompletionRequest); `parser` and
        `reasoning` name its tool-call and reasoning parsers."""
        found = [*_response_format(req), *_sglang_fields(req)]
        calls = self._tool_grammar(req, tools, tool_choice, parser)
        if calls is not None and found:
            raise bad_request(
                "a grammar from response_format/regex/ebnf cannot be combined with a forced or "
                "strict tool call; give one", found[0][1],
            )  # fmt: skip
        found += [calls] if calls is not None else []
        if not found:
            return {}
        if len(found) > 1:
            raise bad_request(f"{found[1][1]} cannot be combined with {found[0][1]}", found[1][1])
        (kind, source), param = found[0][0], found[0][1]
        self.check(kind, source, param)
        # The grammar starts after thinking only where a reasoning parser takes the thinking
        # out of the content (without one, all of the output is the answer); thinking then ends
        # only at `</think>` for both (see dsaserve.grammar.thinking).
        thinks = prompt.rstrip().endswith("<think>") and self.think_end is not None
        if not thinks or reasoning not in REASONING_PARSERS:
            return {kind: source, "grammar_after_token_id": None}
        exits = [THINK_END, *REASONING_PARSERS[reasoning].exits]
        return {kind: source, "grammar_after_token_id": self.think_end,
                "grammar_think_exits": exits}  # fmt: skip

    def native_fields(self, fields: dict, prefix: str = "") -> dict:
        """`/generate` sampling_params or completion fields: JSON-schema objects become text."""
        out = {}
        for kind in ("json_schema", "regex", "ebnf"):
            value = fields.get(kind)
            if value is None:
                continue
            source = value if isinstance(value, str) else json.dumps(value)
            self.check(kind, source, prefix + kind)
            out[kind] = source
        if len(out) > 1:
            raise bad_request("give one of json_schema, regex, ebnf", prefix + list(out)[1])
        return out

    def check(self, kind: str, source: str, param: str) -> None:
        if kind not in GRAMMAR_FIELDS:
            raise bad_request(f"unknown grammar kind {kind}", param)
        if self.backend == "none":
            raise bad_request("structured output is off on this server (--grammar-backend none)",
                              param)  # fmt: skip
        if self._checker is None:
            self._checker = make_checker(self.backend)
        try:
            self._checker.check(kind, source)
        except GrammarError as e:
            raise bad_request(f"{param}: {e}", param) from e

    def _tool_grammar(
        self, req: Any, tools: list[dict], tool_choice: Any, parser: str | None
    ) -> tuple[tuple[str, str], str] | None:
        forcing = tool_choice == "required" or isinstance(tool_choice, dict)
        strict = any(t["function"].get("strict") for t in tools)
        if not tools or tool_choice == "none" or not (forcing or strict):
            return None
        if not tool_calls.supports(parser):
            return None  # no grammar for this format (yet): tool_choice is a request, not a rule
        source = tool_calls.tool_call_grammar(parser, tools, tool_choice, req.parallel_tool_calls)
        return ("tool_call_grammar", source), "tool_choice" if forcing else "tools"


def _response_format(req: Any) -> list[tuple[tuple[str, str], str]]:
    fmt = req.response_format
    if fmt is None or fmt.type == "text":
        return []
    if fmt.type == "json_object":
        return [(("json_schema", JSON_OBJECT), "response_format")]
    spec = fmt.json_schema
    if spec is None or spec.schema_ is None:
        raise bad_request("response_format json_schema needs json_schema.schema", SCHEMA_PARAM)
    return [(("json_schema", json.dumps(spec.schema_)), SCHEMA_PARAM)]


def _sglang_fields(req: Any) -> list[tuple[tuple[str, str], str]]:
    out = []
    for kind in ("json_schema", "regex", "ebnf"):
        value = getattr(req, kind, None)
        if value is not None:
            out.append(((kind, value if isinstance(value, str) else json.dumps(value)), kind))
    return out
