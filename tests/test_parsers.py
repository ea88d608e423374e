"""Unit checks of the GLM output parsers (serving-api.md §1-2; field reports A and B)."""

from __future__ import annotations

import itertools
import json

import pytest

from dsaserve.grammar.tool_schema import allowed_types, convert_value
from dsaserve.server.parsers.chat_output import ChatOutputParser, collect
from dsaserve.server.parsers.choice import (
    ParserConfigError,
    resolve_reasoning_parser,
    resolve_tool_parser,
)
from dsaserve.server.parsers.reasoning import Glm45ReasoningParser
from dsaserve.server.parsers.tool_glm47 import Glm45ToolParser, Glm47ToolParser

SCHEMA = {
    "s": {"type": "string"}, "i": {"type": "integer"}, "n": {"type": "number"},
    "b": {"type": "boolean"}, "o": {"type": "object"}, "a": {"type": "array"},
    "u": {"type": ["integer", "string"]}, "e": {"enum": ["red", "green"]},
    "any": {"anyOf": [{"type": "number"}, {"type": "null"}]},
}  # fmt: skip
TOOLS = [
    {"type": "function", "function": {"name": "f", "parameters": {"properties": SCHEMA}}},
    {"type": "function", "function": {"name": "now", "parameters": {"type": "object"}}},
]


def parse(text: str, force: bool = True, finish: str = "stop", tools=TOOLS, cls=Glm47ToolParser):
    ids = itertools.count()
    parser = ChatOutputParser(
        Glm45ReasoningParser(force), cls(tools, lambda: f"call_{next(ids)}") if tools else None
    )
    return collect(parser.feed(text) + parser.finish(finish))


def args_of(text: str) -> list[dict]:
    return [json.loads(c.arguments) for c in parse(text).tool_calls]


def call(name: str, **kw: str) -> str:
    pairs = "".join(f"<arg_key>{k}</arg_key><arg_value>{v}</arg_value>" for k, v in kw.items())
    return f"<tool_call>{name}{pairs}</tool_call>"


def test_reasoning_split_modes():
    assert parse("R</think>C") == parse("<think>R</think>C")  # leading <think> dropped
    msg = parse("R</think>C")
    assert (msg.reasoning, msg.content) == ("R", "C")
    assert parse("plain answer", force=False).reasoning is None
    assert parse("<think>R</think>C", force=False).reasoning == "R"  # model-opened thinking
    msg = parse("R" + call("now") + "after")  # a tool call before </think> ends reasoning
    assert msg.reasoning == "R" and [c.name for c in msg.tool_calls] == ["now"]
    assert msg.content == "after"


def test_stop_without_end_tag_keeps_the_answer():
    msg = parse("Hello there", finish="stop")  # B15: the model skipped thinking
    assert msg.content == "Hello there"
    msg = parse("still thinking", finish="length")  # a truncated thought stays reasoning
    assert msg.reasoning == "still thinking" and msg.content is None


def test_values_typed_by_schema():
    text = call("f", s="12345", i="7", n="1.5", b="true", o='{"k": [1]}', a="[1, 2]",
                u="x1", e="red", any="null", extra="4")  # fmt: skip
    assert args_of("</think>" + text) == [{
        "s": "12345", "i": 7, "n": 1.5, "b": True, "o": {"k": [1]}, "a": [1, 2], "u": "x1",
        "e": "red", "any": None, "extra": 4}]  # fmt: skip
    assert convert_value("True", allowed_types({"type": "boolean"})) is True
    assert convert_value('"5"', allowed_types({"type": "integer"})) == 5
    assert convert_value("1.5", allowed_types({"type": "integer"})) == 1.5  # not truncated
    assert convert_value("  keep  ", allowed_types({"type": "string"})) == "  keep  "


def test_zero_argument_parallel_unknown_and_unterminated():
    text = "</think>" + call("now") + call("nope", x="1") + call("f", s="a") + "<tool_call>now"
    msg = parse(text)
    assert [c.name for c in msg.tool_calls] == ["now", "f", "now"]
    assert [json.loads(c.arguments) for c in msg.tool_calls] == [{}, {"s": "a"}, {}]
    assert msg.content is None  # no markup leaks into content
    msg = parse("</think>" + "<tool_call>f<arg_key>s</arg_key><arg_value>cut off")
    assert json.loads(msg.tool_calls[0].arguments) == {"s": "cut off"}


def test_markup_never_reaches_content_or_names():
    msg = parse("</think>a</tool_call>b<arg_key>c" + call(" f\n", s="x") + "</arg_value>d")
    assert msg.content == "abcd"
    assert [c.name for c in msg.tool_calls] == ["f"]


def test_glm45_layout_with_newlines():
    text = (
        "</think>before<tool_call>f\n<arg_key>s</arg_key>\n<arg_value>v</arg_value>\n</tool_call>"
    )
    msg = parse(text, cls=Glm45ToolParser)
    assert msg.content == "before" and json.loads(msg.tool_calls[0].arguments) == {"s": "v"}
    assert parse(text).tool_calls[0].arguments == msg.tool_calls[0].arguments


def test_streamed_argument_fragments():
    parser = Glm47ToolParser(TOOLS)
    events = []
    for piece in ["<tool_call>f<arg_", "key>s</arg_key><arg_value>Be", "ijing</arg_value>",
                  "</tool_call>"]:  # fmt: skip
        events += parser.feed(piece)
    fragments = [e.fragment for e in events if hasattr(e, "fragment")]
    assert fragments == ['{"s": ', '"', "Be", 'ijing"', "}"]  # strings stream as they come


def test_auto_detection(tmp_path):
    from dsaserve.assets import default_model_path

    glm5 = (default_model_path() / "chat_template.jinja").read_text()
    vocab = {"<tool_call>", "<|user|>"}
    assert resolve_reasoning_parser("auto", glm5, vocab) == "glm45"
    assert resolve_tool_parser("auto", glm5) == "glm47"
    old = glm5.replace(
        "<tool_call>{function-name}<arg_key>", "<tool_call>{function-name}\\n<arg_key>"
    )
    assert resolve_tool_parser("auto", old) == "glm45"
    assert resolve_reasoning_parser("auto", "{{ messages }}", vocab) is None
    assert resolve_tool_parser("none", glm5) is None
    with pytest.raises(ParserConfigError):
        resolve_reasoning_parser("qwen3", glm5, vocab)
