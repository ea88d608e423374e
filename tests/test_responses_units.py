"""The Responses route's parts without a server: items -> chat messages, parser events -> output
items and stream events, and the bounded store."""

from __future__ import annotations

import json

import pytest

from dsaserve.server.openai.responses_events import EventStream, OutputItems
from dsaserve.server.openai.responses_items import to_chat_body
from dsaserve.server.openai.responses_protocol import InputItem, ResponsesRequest
from dsaserve.server.openai.responses_store import ResponseStore
from dsaserve.server.parsers.events import Content, Reasoning, ToolCallArgs, ToolCallStart
from dsaserve.web.errors import APIError

WEATHER = {"type": "function", "name": "get_weather", "parameters": {"type": "object"}}


def chat_of(**fields) -> dict:
    return to_chat_body(ResponsesRequest.model_validate(fields), []).body


def test_items_become_the_chat_turns_the_template_renders():
    body = chat_of(instructions="Be brief.", tools=[WEATHER, {"type": "web_search"}], input=[
        {"role": "developer", "content": [{"type": "input_text", "text": "Rules."}]},
        {"type": "message", "role": "user", "content": "Weather?"},
        {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "S"}],
         "content": [{"type": "reasoning_text", "text": "I will call it."}]},
        {"type": "message", "role": "assistant",
         "content": [{"type": "output_text", "text": "Ok."}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather",
         "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "Only a summary."}]},
        {"type": "message", "role": "assistant", "content": "It is sunny."},
        {"type": "web_search_call", "id": "ws_1"},
        {"role": "user", "content": "Thanks"},
    ])  # fmt: skip
    assert body["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "developer", "content": "Rules."},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "Ok.", "reasoning_content": "I will call it.",
         "tool_calls": [{"id": "call_1", "type": "function",
                         "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "assistant", "content": "It is sunny.", "reasoning_content": "Only a summary."},
        {"role": "user", "content": "Thanks"},
    ]  # fmt: skip
    assert body["tools"] == [{"type": "function", "function": {
        "name": "get_weather", "parameters": {"type": "object"}}}]  # fmt: skip
    left_out = to_chat_body(ResponsesRequest.model_validate(
        {"input": [{"type": "web_search_call"}, {"role": "user", "content": "hi"}],
         "tools": [{"type": "namespace", "name": "x"}]}),
        []).left_out  # fmt: skip
    assert left_out == ["web_search_call item", "namespace tool x"]


def test_request_fields_map_to_chat_fields():
    body = chat_of(input="hi", max_output_tokens=7, temperature=0.5, top_p=0.9,
                   reasoning={"effort": "xhigh", "summary": "auto"}, parallel_tool_calls=False,
                   text={"format": {"type": "json_schema", "name": "a", "strict": True,
                                    "schema": {"type": "object"}}}, tools=[WEATHER],
                   tool_choice={"type": "function", "name": "get_weather"})  # fmt: skip
    assert body["messages"] == [{"role": "user", "content": "hi"}]
    assert (body["max_tokens"], body["temperature"], body["top_p"]) == (7, 0.5, 0.9)
    assert body["reasoning_effort"] == "max" and body["parallel_tool_calls"] is False
    assert body["response_format"] == {"type": "json_schema", "json_schema": {
        "name": "a", "schema": {"type": "object"}, "strict": True}}  # fmt: skip
    assert body["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    allowed = {"type": "allowed_tools", "mode": "required",
               "tools": [{"type": "function", "name": "get_time"}]}  # fmt: skip
    other = dict(WEATHER, name="get_time")
    body = chat_of(input="hi", tools=[WEATHER, other], tool_choice=allowed)
    assert body["tool_choice"] == "required"
    assert [t["function"]["name"] for t in body["tools"]] == ["get_time"]
    assert chat_of(input="x", text={"format": {"type": "json_object"}})["response_format"] == {
        "type": "json_object"}  # fmt: skip


@pytest.mark.parametrize("item, param", [
    ({"type": "message", "content": "no role"}, "input[0].role"),
    ({"role": "user", "content": [{"type": "input_image", "image_url": "x"}]},
     "input[0].content[0]"),
    ({"type": "function_call", "name": "f", "arguments": "{}"}, "input[0].call_id"),
    ({"type": "function_call", "call_id": "c", "name": "f", "arguments": "[1]"},
     "input[0].arguments"),
    ({"type": "function_call", "call_id": "c", "name": "f", "arguments": "{x"},
     "input[0].arguments"),
    ({"type": "function_call_output", "output": "x"}, "input[0].call_id"),
    ({"type": "item_reference", "id": "msg_1"}, "input[0]"),
])  # fmt: skip
def test_bad_items_name_the_field(item: dict, param: str):
    with pytest.raises(APIError) as caught:
        chat_of(input=[item])
    assert caught.value.status == 400 and caught.value.param == param


def test_history_comes_first_and_its_errors_name_previous_response_id():
    history = [InputItem(role="user", content="first")]
    req = ResponsesRequest.model_validate({"input": "second", "instructions": "New rules."})
    messages = to_chat_body(req, history).body["messages"]
    assert [m["content"] for m in messages] == ["New rules.", "first", "second"]
    with pytest.raises(APIError) as caught:
        to_chat_body(req, [InputItem(type="function_call", name="f")])
    assert caught.value.param.startswith("previous_response_id")


def replay(summary: bool, events: list, status: str = "completed") -> tuple[list, list]:
    items = OutputItems(summary)
    out = items.feed(events) + items.close(status)
    return items.items, out


def test_events_build_the_items_and_add_up_to_them():
    events = [Reasoning("Think"), Reasoning("ing."), Content("Let me "), Content("check."),
              ToolCallStart(0, "call_a", "get_weather"), ToolCallArgs(0, '{"city": '),
              ToolCallArgs(0, '"Paris"}'), ToolCallStart(1, "call_b", "get_time"),
              ToolCallArgs(1, "{}")]  # fmt: skip
    items, stream = replay(True, events)
    assert [i["type"] for i in items] == ["reasoning", "message", "function_call", "function_call"]
    assert items[0]["summary"] == [{"type": "summary_text", "text": "Thinking."}]
    assert items[1]["content"][0]["text"] == "Let me check."
    assert (items[2]["call_id"], items[2]["arguments"]) == ("call_a", '{"city": "Paris"}')
    assert all(i["status"] == "completed" for i in items)
    kinds = [e["type"] for e in stream]
    assert kinds[:4] == ["response.output_item.added", "response.reasoning_summary_part.added",
                         "response.reasoning_summary_text.delta",
                         "response.reasoning_summary_text.delta"]  # fmt: skip
    for index, item in enumerate(items):
        mine = [e for e in stream if e.get("output_index") == index]
        added, done = mine[0], mine[-1]
        assert added["type"] == "response.output_item.added" and added["item"]["id"] == item["id"]
        assert done == {"type": "response.output_item.done", "output_index": index, "item": item}
        deltas = "".join(e["delta"] for e in mine if e["type"].endswith(".delta"))
        whole = item.get("arguments") or (item.get("summary") or item["content"])[0]["text"]
        assert deltas == whole
    frames = EventStream()
    numbered = [json.loads(frames.frame(e).split("data: ", 1)[1]) for e in stream]
    assert [e["sequence_number"] for e in numbered] == list(range(len(stream)))


def test_reasoning_without_a_summary_is_content_and_a_cut_item_is_incomplete():
    items, stream = replay(False, [Reasoning("Hmm, "), Reasoning("long")], "incomplete")
    text = [{"type": "reasoning_text", "text": "Hmm, long"}]
    assert items == [{"id": items[0]["id"], "type": "reasoning", "status": "incomplete",
                      "summary": [], "content": text}]  # fmt: skip
    assert [e["type"] for e in stream] == [
        "response.output_item.added", "response.content_part.added",
        "response.reasoning_text.delta", "response.reasoning_text.delta",
        "response.reasoning_text.done", "response.content_part.done",
        "response.output_item.done"]  # fmt: skip
    assert stream[0]["item"]["status"] == "in_progress" and stream[0]["item"]["content"] == []


def response(i: int, size: int = 10) -> dict:
    return {"id": f"resp_{i}", "output": [{"type": "message", "text": "x" * size}]}


def test_store_is_bounded_lru_and_links_turns():
    store = ResponseStore(max_entries=3)
    store.put(response(1), [{"role": "user", "content": "a"}], None)
    store.put(response(2), [{"role": "user", "content": "b"}], "resp_1")
    store.put(response(3), [], None)
    history = store.history("resp_2")  # refreshes resp_2 and resp_1
    assert [i.get("content") for i in history] == ["a", None, "b", None]
    store.put(response(4), [], None)  # drops resp_3, the least recently used
    assert store.get("resp_3") is None and store.get("resp_1") is not None
    assert store.delete("resp_1") and not store.delete("resp_1")
    assert store.history("resp_2") is None  # an earlier turn is gone: cannot continue
    small = ResponseStore(max_entries=10, max_bytes=300)
    small.put(response(1, 100), [], None)
    small.put(response(2, 100), [], None)
    assert small.get("resp_1") is None and small.get("resp_2") is not None  # byte bound
    assert small.bytes <= 300
    assert not small.put(response(3, 1000), [], None) and small.get("resp_3") is None
