"""DeepSeek-V3.2 output parsing: `deepseek-v3` reasoning and `deepseekv32` DSML tool calls.

Field reports A12/A13 (sglang#40236, #35736, PR #18236/#19662): malformed or unterminated DSML
must still become tool calls (never `content` with finish `stop`), `tool_choice: "none"` must not
leak markup, and streaming must equal non-streaming at every chunk split (property test)."""

from __future__ import annotations

import itertools
import json

from hypothesis import given, settings
from hypothesis import strategies as st

from dsaserve.engine.messages import RequestOutput
from dsaserve.sampling_params import SamplingParams
from dsaserve.server.generation import ChatChoice
from dsaserve.server.parsers.chat_output import ChatOutputParser, collect
from dsaserve.server.parsers.events import ToolCallArgs, ToolCallStart
from dsaserve.server.parsers.reasoning_deepseek import DeepSeekV3ReasoningParser
from dsaserve.server.parsers.tool_dsml import DSML, DsmlToolParser
from dsaserve.server.tokenizer_manager import PreparedChat

D = DSML
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {
            "location": {"type": "string"}, "days": {"type": "integer"},
            "ok": {"type": "boolean"}, "opts": {"type": "object"},
            "x": {"anyOf": [{"type": "number"}, {"type": "null"}]}}}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}},
]  # fmt: skip


def call(name: str, *params: tuple[str, str, str], close: bool = True) -> str:
    body = "".join(
        f'<{D}parameter name="{k}" string="{s}">{v}</{D}parameter>\n' for k, s, v in params
    )
    return f'<{D}invoke name="{name}">\n{body}' + (f"</{D}invoke>\n" if close else "")


def section(*calls: str, close: bool = True) -> str:
    end = f"</{D}function_calls>" if close else ""
    return f"\n\n<{D}function_calls>\n" + "".join(calls) + end


def run(text: str, cuts: list[int] | None = None, thinking: bool = True, finish: str = "stop"):
    ids = itertools.count()
    parser = ChatOutputParser(
        DeepSeekV3ReasoningParser(thinking), DsmlToolParser(TOOLS, lambda: f"call_{next(ids)}")
    )
    bounds = [0, *sorted(c % (len(text) + 1) for c in cuts or []), len(text)]
    events = []
    for start, end in itertools.pairwise(bounds):
        events += parser.feed(text[start:end])
    events += parser.finish(finish)
    return events, collect(events)


def arguments(message) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in message.tool_calls]


def test_well_formed_output_with_typed_arguments():
    text = "The user wants weather.</think>Let me check." + section(
        call("get_weather", ("location", "true", "12345"), ("days", "false", "3"),
             ("ok", "false", "true"), ("opts", "false", '{"a": [1]}'), ("x", "false", "null")),
        call("get_time"),
    )  # fmt: skip
    _, message = run(text)
    assert message.reasoning == "The user wants weather."
    assert message.content == "Let me check."
    assert arguments(message) == [
        ("get_weather", {"location": "12345", "days": 3, "ok": True, "opts": {"a": [1]},
                         "x": None}),
        ("get_time", {}),
    ]  # fmt: skip


def test_schema_has_the_last_word_and_string_attr_types_undeclared_keys():
    text = section(call("get_weather", ("days", "true", "4"), ("location", "false", "007"),
                        ("extra", "false", "[1, 2]"), ("note", "true", "[1, 2]")))  # fmt: skip
    _, message = run(text, thinking=False)
    assert arguments(message) == [
        ("get_weather", {"days": 4, "location": "007", "extra": [1, 2], "note": "[1, 2]"})
    ]


def test_strings_stream_as_they_arrive():
    text = section(call("get_weather", ("location", "true", "Beijing")))
    events, _ = run(text, cuts=list(range(len(text))), thinking=False)
    fragments = "".join(e.fragment for e in events if isinstance(e, ToolCallArgs))
    assert fragments == '{"location": "Beijing"}'
    pieces = [e.fragment for e in events if isinstance(e, ToolCallArgs)]
    assert pieces[:3] == ['{"location": "', "B", "e"]  # streamed character by character


def test_field_report_shapes_still_become_tool_calls():
    bare = call("get_weather", ("location", "true", "Oslo"))  # no function_calls section
    unterminated = section(call("get_weather", ("days", "false", "2"), close=False), close=False)
    cut_value = f'<{D}function_calls>\n<{D}invoke name="get_weather">\n<{D}parameter ' \
                f'name="location" string="true">Ro'  # fmt: skip
    sibling = section(
        call("get_time", close=False),  # a sibling opens before this one closes
        f"<{D}invoke name=get_weather>\n<{D}parameter name=days>5</{D}parameter>\n</{D}invoke>\n",
    )
    json_body = section(f'<{D}invoke name="get_weather">\n{{"days": 1}}\n</{D}invoke>\n')
    lost_bracket = f'<{D}invoke name="get_weather"\n<{D}parameter name="days">6</{D}parameter>'
    cases = {
        bare: [("get_weather", {"location": "Oslo"})],
        unterminated: [("get_weather", {"days": 2})],
        cut_value: [("get_weather", {"location": "Ro"})],
        sibling: [("get_time", {}), ("get_weather", {"days": 5})],
        json_body: [("get_weather", {"days": 1})],
        lost_bracket: [("get_weather", {"days": 6})],
    }
    for text, expected in cases.items():
        for thinking, prefix in ((True, "R"), (False, "")):
            _, message = run(prefix + text, thinking=thinking)
            assert arguments(message) == expected, text
            assert D not in (message.content or "") and D not in (message.reasoning or "")


def choice_for(text: str, tool_choice: str) -> ChatChoice:
    prepared = PreparedChat(
        prompt="", input_ids=[], sampling=SamplingParams(), force_reasoning=False,
        reasoning_parser="deepseek-v3", tool_parser="deepseekv32", tools=TOOLS,
        tool_choice=tool_choice,
    )  # fmt: skip
    choice = ChatChoice.create(prepared, separate_reasoning=True)
    choice.update(RequestOutput(rid="r", token_ids=[0], text=text, finished=True,
                                finish_reason={"type": "stop"}))  # fmt: skip
    return choice


def test_finish_reason_and_tool_choice_none():
    bare = "Checking." + call("get_weather", ("location", "true", "Oslo"), close=False)
    choice = choice_for(bare, "auto")
    assert choice.finish_reason == "tool_calls"  # not content with finish "stop"
    assert collect(choice.events).content == "Checking."
    none = choice_for(bare, "none")
    assert none.finish_reason == "stop" and not collect(none.events).tool_calls
    assert collect(none.events).content == "Checking."  # no markup leaks (sglang#35736)


def test_thinking_switch():
    assert run("R</think>C")[1].reasoning == "R"
    off = run("<think>R</think>C", thinking=False)[1]
    assert (off.reasoning, off.content) == (None, "<think>R</think>C")  # thinking off: content
    implicit = run("R" + section(call("get_time")))[1]  # a call ends thinking without </think>
    assert (implicit.reasoning, arguments(implicit)) == ("R\n\n", [("get_time", {})])
    unclosed = run("The answer is 4.")[1]  # stopped inside thinking: the answer is not lost
    assert unclosed.content == "The answer is 4."


# ---- property: any output, any chunking, streaming == non-streaming
TEXT = st.text(alphabet=st.sampled_from(list('ab <>/\n"=\\{}:é漢_｜')), max_size=10)
VALUES = {
    "location": TEXT, "days": st.integers(-5, 10**6).map(str),
    "ok": st.sampled_from(["true", "false"]), "x": st.sampled_from(["1.5", "null", "7"]),
    "opts": st.dictionaries(st.sampled_from(["a", "b"]), st.integers()).map(json.dumps),
    "other": TEXT,
}  # fmt: skip


@st.composite
def invoke(draw: st.DrawFn) -> str:
    name = draw(st.sampled_from(["get_weather", "get_time", "unknown_tool", " get_weather "]))
    quote = draw(st.sampled_from(['"', ""]))
    params = ""
    for key in draw(st.lists(st.sampled_from(sorted(VALUES)), unique=True, max_size=3)):
        attr = draw(st.sampled_from([' string="true"', ' string="false"', ""]))
        close = draw(st.sampled_from([f"</{D}parameter>", ""]))
        params += f"<{D}parameter name={quote}{key}{quote}{attr}>{draw(VALUES[key])}{close}\n"
    if not params and draw(st.booleans()):
        params = draw(st.sampled_from(['{"days": 2}', "[1]", "oops"]))
    end = draw(st.sampled_from([f"</{D}invoke>\n", ""]))
    return f"<{D}invoke name={quote}{name}{quote}>\n{params}{end}"


@st.composite
def model_output(draw: st.DrawFn) -> str:
    parts = []
    if draw(st.booleans()):
        parts.append(draw(TEXT) + draw(st.sampled_from(["</think>", "", "</think>\n\n"])))
    for _ in range(draw(st.integers(0, 3))):
        calls = "".join(draw(st.lists(invoke(), max_size=3)))
        opened = draw(st.sampled_from([f"\n\n<{D}function_calls>\n", ""]))
        closed = draw(st.sampled_from([f"</{D}function_calls>", ""]))
        parts.append(draw(st.one_of(TEXT, st.just(opened + calls + closed))))
    return "".join(parts)


@settings(max_examples=300, deadline=None)
@given(
    text=model_output(),
    cuts=st.lists(st.integers(0, 10**4), max_size=8),
    thinking=st.booleans(),
    finish=st.sampled_from(["stop", "length"]),
)
def test_streaming_equals_non_streaming(text: str, cuts: list[int], thinking: bool, finish: str):
    _, whole = run(text, [], thinking, finish)
    events, streamed = run(text, cuts, thinking, finish)
    assert streamed == whole
    _, closed = run(text, [], thinking, "stop")  # the same text, ended (not cut)
    for index, parsed in enumerate(streamed.tool_calls):
        assert parsed.name in ("get_weather", "get_time")
        if finish == "length" and index == len(streamed.tool_calls) - 1:
            # cut by max_tokens: as cut, a prefix of what ending would close it as
            assert closed.tool_calls[index].arguments.startswith(parsed.arguments)
            continue
        assert isinstance(json.loads(parsed.arguments), dict)  # one JSON object per call
    assert f"<{D}" not in (streamed.content or "") and f"</{D}" not in (streamed.content or "")
    starts = [e for e in events if isinstance(e, ToolCallStart)]
    assert [s.index for s in starts] == list(range(len(starts)))
    assert {e.index for e in events if isinstance(e, ToolCallArgs)} <= {s.index for s in starts}
