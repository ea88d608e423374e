"""Property: for any model output, streamed deltas add up to the non-streamed message, at every
chunk split (reasoning + tool parsers together; field reports A1-A6, B16)."""

from __future__ import annotations

import itertools
import json

from hypothesis import given, settings
from hypothesis import strategies as st

from dsaserve.server.parsers.chat_output import ChatOutputParser, collect
from dsaserve.server.parsers.events import ToolCallArgs, ToolCallStart
from dsaserve.server.parsers.reasoning import Glm45ReasoningParser
from dsaserve.server.parsers.tool_glm47 import MARKUP, Glm45ToolParser, Glm47ToolParser

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {
            "location": {"type": "string"}, "days": {"type": "integer"},
            "unit": {"type": "string", "enum": ["c", "f"]}, "ok": {"type": "boolean"},
            "opts": {"type": "object"}, "tags": {"type": "array", "items": {"type": "string"}},
            "x": {"anyOf": [{"type": "number"}, {"type": "null"}]}}}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}},
]  # fmt: skip
TEXT = st.text(alphabet=st.sampled_from(list('ab <>/\n"\\{}:é漢😀_=')), max_size=12)
VALUES = {
    "location": TEXT,
    "days": st.integers(-5, 10**6).map(str),
    "unit": st.sampled_from(["c", "f"]),
    "ok": st.sampled_from(["true", "false"]),
    "opts": st.dictionaries(st.sampled_from(["a", "b"]), st.integers()).map(json.dumps),
    "tags": st.lists(st.sampled_from(["x", "y z"])).map(json.dumps),
    "x": st.sampled_from(["1.5", "null", "7"]),
    "other": TEXT,
}


@st.composite
def tool_call(draw: st.DrawFn) -> str:
    name = draw(st.sampled_from(["get_weather", "get_time", "unknown_tool", " get_weather\n"]))
    keys = draw(st.lists(st.sampled_from(sorted(VALUES)), unique=True, max_size=4))
    args = "".join(
        f"<arg_key>{k}</arg_key>{draw(st.sampled_from(['', chr(10)]))}"
        f"<arg_value>{draw(VALUES[k])}</arg_value>"
        for k in keys
    )
    closed = draw(st.booleans()) or draw(st.booleans())
    return f"<tool_call>{name}{args}" + ("</tool_call>" if closed else "")


@st.composite
def model_output(draw: st.DrawFn) -> str:
    parts = []
    if draw(st.booleans()):
        parts.append(draw(st.sampled_from(["", "<think>"])) + draw(TEXT))
        parts.append(draw(st.sampled_from(["</think>", "", "</think>\n\n"])))
    for _ in range(draw(st.integers(0, 3))):
        parts.append(draw(st.one_of(TEXT, tool_call())))
    return "".join(parts)


def run(text: str, cuts: list[int], force: bool, finish: str, cls=Glm47ToolParser) -> tuple:
    ids = itertools.count()
    parser = ChatOutputParser(Glm45ReasoningParser(force), cls(TOOLS, lambda: f"call_{next(ids)}"))
    bounds = [0, *sorted(c % (len(text) + 1) for c in cuts), len(text)]
    events = []
    for start, end in itertools.pairwise(bounds):
        events += parser.feed(text[start:end])
    events += parser.finish(finish)
    return events, collect(events)


@settings(max_examples=300, deadline=None)
@given(
    text=model_output(),
    cuts=st.lists(st.integers(0, 10**4), max_size=8),
    force=st.booleans(),
    finish=st.sampled_from(["stop", "length"]),
    cls=st.sampled_from([Glm47ToolParser, Glm45ToolParser]),
)
def test_streaming_equals_non_streaming(
    text: str, cuts: list[int], force: bool, finish: str, cls: type
):
    _, whole = run(text, [], force, finish, cls)
    events, streamed = run(text, cuts, force, finish, cls)
    assert streamed == whole
    _, closed = run(text, [], force, "stop", cls)  # the same text, ended (not cut)
    for index, call in enumerate(streamed.tool_calls):
        assert call.name in ("get_weather", "get_time")
        if finish == "length" and index == len(streamed.tool_calls) - 1:
            # a call cut by max_tokens stays as cut: a prefix of what ending would close it as,
            # with no value nobody wrote
            assert closed.tool_calls[index].arguments.startswith(call.arguments)
            continue
        assert isinstance(json.loads(call.arguments), dict)  # one valid JSON object per call
    for tag in MARKUP:
        assert tag not in (streamed.content or "")
    starts = [e for e in events if isinstance(e, ToolCallStart)]
    assert [s.index for s in starts] == list(range(len(starts)))  # call order, once per call
    first_args = {}
    for e in events:
        if isinstance(e, ToolCallArgs):
            first_args.setdefault(e.index, e)
    assert all(any(s.index == i for s in starts) for i in first_args)


@settings(max_examples=100, deadline=None)
@given(chunks=st.lists(TEXT, max_size=6), cuts=st.lists(st.integers(0, 100), max_size=5))
def test_char_by_char_plain_text(chunks: list[str], cuts: list[int]):
    text = "".join(chunks)
    _, whole = run(text, [], False, "stop")
    _, by_char = run(text, list(range(len(text))), False, "stop")
    assert by_char == whole
