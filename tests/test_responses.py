"""`/v1/responses` on the shared server (tiny random GLM model + scripted outputs), driven with the
official `openai` SDK (`client.responses.*`) and raw HTTP: output items, the stream's event
sequence and ids, tool calls and their round trip rendered exactly as chat renders them, the
store, what Codex sends, errors in the Responses shape, and SGLang's metrics."""

from __future__ import annotations

import json
import re

import httpx
import openai
import pytest
from server_harness import CONTEXT_LENGTH, Server, wait_for

WEATHER = {"type": "function", "name": "get_weather", "description": "Get the weather",
           "parameters": {"type": "object", "required": ["location"], "properties": {
               "location": {"type": "string"}, "days": {"type": "integer"}}}}  # fmt: skip
TIME = {"type": "function", "name": "get_time", "parameters": {"type": "object"}}
TOOLS = [WEATHER, TIME]
CHAT_TOOLS = [{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}}
              for t in TOOLS]  # fmt: skip
WEATHER_OUT = {"location": "Beijing", "days": 3}


@pytest.fixture(scope="module")
def client(main_server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=main_server.base, api_key="unused", max_retries=0, timeout=120)


def ask(script: str) -> list[dict]:
    return [{"role": "user", "content": f"Please [[script:{script}]]"}]


def dumps(response) -> list[dict]:
    """A response's output items as a client sends them back."""
    return [item.model_dump(exclude_none=True) for item in response.output]


def test_answer_with_its_reasoning_item(client: openai.OpenAI):
    r = client.responses.create(model="glm-5", input="Please [[script:answer]]")
    assert r.object == "response" and r.id.startswith("resp_") and r.status == "completed"
    assert r.model == "glm-5" and r.error is None and r.store is False
    assert [o.type for o in r.output] == ["reasoning", "message"]
    reasoning, message = r.output
    assert reasoning.id.startswith("rs_") and message.id.startswith("msg_")
    assert reasoning.content[0].text == "Reasoning here." and reasoning.summary == []
    assert reasoning.encrypted_content is None  # never produced
    assert message.role == "assistant" and message.status == "completed"
    assert r.output_text == "The answer is 42."
    usage = r.usage
    assert usage.input_tokens > 0 and usage.output_tokens > 0
    assert 0 < usage.output_tokens_details.reasoning_tokens < usage.output_tokens
    assert usage.input_tokens_details.cached_tokens == 0  # scripted: never cached
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    summary = client.responses.create(model="m", input=ask("answer"), reasoning={"summary": "auto"})
    assert summary.output[0].summary[0].text == "Reasoning here."
    assert summary.output[0].content is None and summary.reasoning.summary == "auto"


def test_tool_call_and_its_round_trip_render_as_chat_does(client: openai.OpenAI):
    first = client.responses.create(model="m", input=ask("weather"), tools=TOOLS)
    assert [o.type for o in first.output] == ["reasoning", "message", "function_call"]
    assert first.output_text == "Let me check."
    call = first.output[2]
    assert call.id.startswith("fc_") and call.call_id.startswith("call_")
    assert call.name == "get_weather" and json.loads(call.arguments) == WEATHER_OUT  # typed
    assert [t.name for t in first.tools] == ["get_weather", "get_time"]
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 20 C"}
    turn = [*ask("weather"), *dumps(first), result, *ask("answer")]
    second = client.responses.create(model="m", input=turn, tools=TOOLS)
    assert second.output_text == "The answer is 42."
    messages = [*ask("weather"),
                {"role": "assistant", "content": "Let me check.",
                 "reasoning_content": "The user wants the weather.",
                 "tool_calls": [{"id": call.call_id, "type": "function",
                                 "function": {"name": call.name, "arguments": call.arguments}}]},
                {"role": "tool", "tool_call_id": call.call_id, "content": "sunny, 20 C"},
                *ask("answer")]  # fmt: skip
    chat = client.chat.completions.create(model="m", messages=messages, tools=CHAT_TOOLS)
    assert chat.usage.prompt_tokens == second.usage.input_tokens  # the same prompt
    without = client.responses.create(model="m", input=[*turn[:-2], *ask("answer")], tools=TOOLS)
    assert without.usage.input_tokens < second.usage.input_tokens  # the output was rendered
    none = client.responses.create(model="m", input=ask("weather"), tools=TOOLS, tool_choice="none")
    assert [o.type for o in none.output] == ["reasoning", "message"]
    assert none.output_text == "Let me check."  # no call, and no markup in the text


def stream_events(client: openai.OpenAI, **kwargs) -> list:
    return list(client.responses.create(stream=True, **kwargs))


def test_stream_event_sequence_ids_and_deltas(client: openai.OpenAI):
    kwargs = {"model": "m", "input": ask("weather"), "tools": TOOLS,
              "reasoning": {"summary": "auto"}}  # fmt: skip
    events = stream_events(client, **kwargs)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed" and kinds.count("response.completed") == 1
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    final = events[-1].response
    assert [o.type for o in final.output] == ["reasoning", "message", "function_call"]
    for index, item in enumerate(final.output):
        mine = [e for e in events if getattr(e, "output_index", None) == index]
        added, done = mine[0], mine[-1]
        assert added.type == "response.output_item.added"
        assert done.type == "response.output_item.done"
        assert added.item.id == done.item.id == item.id and added.item.status == "in_progress"
        assert done.item.model_dump() == item.model_dump()
        assert all(e.item_id == item.id for e in mine[1:-1])
        deltas = "".join(e.delta for e in mine if e.type.endswith(".delta"))
        if item.type == "function_call":
            assert added.item.call_id == item.call_id and deltas == item.arguments
            args_done = next(e for e in mine if e.type == "response.function_call_arguments.done")
            assert json.loads(args_done.arguments) == WEATHER_OUT
        elif item.type == "message":
            assert deltas == item.content[0].text == "Let me check."
            assert [e.type for e in mine[1:3]] == ["response.content_part.added",
                                                  "response.output_text.delta"]  # fmt: skip
        else:
            assert deltas == item.summary[0].text == "The user wants the weather."
            assert mine[1].type == "response.reasoning_summary_part.added"
    whole = client.responses.create(**kwargs)
    shape = lambda r: [(o.type, o.model_dump(exclude={"id", "call_id"}, exclude_none=True))  # noqa: E731
                       for o in r.output]  # fmt: skip
    assert shape(final) == shape(whole)
    with client.responses.stream(**kwargs) as stream:  # the SDK's own accumulation agrees
        assert shape(stream.get_final_response()) == shape(whole)


def test_previous_response_id_store_get_delete(client: openai.OpenAI):
    first = client.responses.create(model="m", input=ask("weather"), tools=TOOLS, store=True,
                                    instructions="Brief.", metadata={"case": "store"})  # fmt: skip
    assert first.store is True and first.metadata == {"case": "store"}
    assert client.responses.retrieve(first.id).model_dump() == first.model_dump()
    call = first.output[-1]
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}
    second = client.responses.create(model="m", previous_response_id=first.id, store=True,
                                     input=[result, *ask("answer")], tools=TOOLS)  # fmt: skip
    assert second.previous_response_id == first.id and second.output_text == "The answer is 42."
    # the stored turn is rendered as if resent (instructions are not carried over, as OpenAI)
    resent = [*ask("weather"), *dumps(first), result, *ask("answer")]
    resent = client.responses.create(model="m", tools=TOOLS, input=resent)
    assert resent.usage.input_tokens == second.usage.input_tokens
    third = stream_events(client, model="m", previous_response_id=second.id, store=True,
                          input="go on [[script:nothink]]")[-1].response  # fmt: skip
    assert client.responses.retrieve(third.id).model_dump() == third.model_dump()
    client.responses.delete(second.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(second.id)
    with pytest.raises(openai.NotFoundError) as missing:
        client.responses.create(model="m", previous_response_id=third.id, input="x")
    error = missing.value.body
    assert error["code"] == "previous_response_not_found"  # its earlier turn was deleted
    assert error["param"] == "previous_response_id"
    unstored = client.responses.create(model="m", input=ask("answer"))
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


CODEX_TOOLS = [
    {"type": "function", "name": "exec_command", "description": "Runs a command.",
     "strict": False, "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}},
                                     "required": ["cmd"], "additionalProperties": False}},
    {"type": "namespace", "name": "multi_agent_v1", "description": "Sub-agents.",
     "tools": [{"type": "function", "name": "close_agent", "strict": False,
                "parameters": {"type": "object", "properties": {}}}]},
    {"type": "web_search", "external_web_access": False},
]  # fmt: skip


def codex_body(tools: list[dict]) -> dict:
    """The shape of Codex CLI 0.171's first turn (captured), with short texts."""
    text = lambda t: [{"type": "input_text", "text": t}]  # noqa: E731
    return {
        "model": "glm-test", "stream": True, "tools": tools, "tool_choice": "auto",
        "input": [{"type": "message", "role": "developer", "content": text("You are Codex.")},
                  {"type": "message", "role": "developer", "content": text("Skills: none.")},
                  {"type": "message", "role": "user", "content": text("<environment_context/>")},
                  {"type": "message", "role": "user", "content": text("Hi [[script:answer]]")}],
        "parallel_tool_calls": True, "reasoning": {"summary": "auto"}, "store": False,
        "include": ["reasoning.encrypted_content"], "prompt_cache_key": "0a1b",
        "client_metadata": {"session_id": "0a1b", "x-codex-turn-metadata": "{}"},
    }  # fmt: skip


def sse_events(r: httpx.Response) -> list[dict]:
    """The `data:` of each SSE frame, checked against its `event:` line."""
    frames = [f for f in r.text.split("\n\n") if f.strip()]
    events = []
    for frame in frames:
        kind, data = frame.split("\n", 1)
        assert kind.startswith("event: ") and data.startswith("data: "), frame
        events.append(json.loads(data[6:]))
        assert events[-1]["type"] == kind[7:]
    return events


def test_what_codex_sends_is_served_and_unrunnable_tools_left_out(main_server: Server):
    r = httpx.post(main_server.base + "/responses", json=codex_body(CODEX_TOOLS), timeout=60)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r)
    final = events[-1]["response"]
    assert events[-1]["type"] == "response.completed"
    assert final["output"][1]["content"][0]["text"] == "The answer is 42."
    assert final["output"][0]["summary"][0]["text"] == "Reasoning here."
    assert final["prompt_cache_key"] == "0a1b" and final["tools"] == CODEX_TOOLS[:1]
    wait_for(lambda: "multi_agent_v1" in main_server.output(), "the log naming the tools left out")
    line = next(x for x in main_server.log if "left out of the prompt" in x)
    assert "namespace tool multi_agent_v1" in line and "web_search tool" in line
    functions_only = sse_events(httpx.post(main_server.base + "/responses", timeout=60,
                                           json=codex_body(CODEX_TOOLS[:1])))  # fmt: skip
    assert functions_only[-1]["response"]["usage"] == final["usage"]  # not in the prompt


ERRORS = [
    ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
    ({"input": [{"type": "message", "content": "x"}]}, "input[0].role"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0]"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
    ({"input": "x", "max_output_tokens": -1}, "max_output_tokens"),
    ({"input": "x", "max_output_tokens": CONTEXT_LENGTH + 1}, "max_output_tokens"),
    ({"input": "x", "background": True}, "background"),
    ({"input": "x", "truncation": "auto"}, "truncation"),
    ({"input": "x", "conversation": "conv_1"}, "conversation"),
    ({"input": "x", "include": ["message.output_text.logprobs"]}, "include"),
    ({"input": "x", "tool_choice": "required"}, "tool_choice"),
    ({"input": "x", "tool_choice": {"type": "web_search_preview"}, "tools": TOOLS}, "tool_choice"),
    ({"input": "x", "tool_choice": {"type": "function", "name": "nope"}, "tools": TOOLS},
     "tool_choice"),
    ({"input": "x", "tools": [{"type": "function", "parameters": {}}]}, "tools[0].name"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "a"}}},
     "text.format.schema"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "a", "schema": {
        "type": "object", "properties": {"a": {"type": "nonsense"}}}}}}, "text.format.schema"),
    ({"input": "x", "reasoning": {"effort": "extreme"}}, "reasoning.effort"),
    ({"input": "x", "metadata": {str(i): "v" for i in range(17)}}, "metadata"),
    ({"input": "hello " * CONTEXT_LENGTH}, "input"),
    ({}, "input"),
    ({"input": "x", "previous_response_id": "resp_nope"}, "previous_response_id"),
]  # fmt: skip


def assert_responses_error(r: httpx.Response, status: int, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    assert len(r.content) < 4000
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"], error
    assert error["type"] == ("server_error" if status >= 500 else "invalid_request_error")
    assert error["code"] is None or isinstance(error["code"], str), error
    assert param is None or error["param"] == param, error
    return error


@pytest.mark.parametrize("body,param", ERRORS)
def test_errors_use_the_responses_shape_and_name_the_field(main_server: Server, body, param):
    status = 404 if param == "previous_response_id" else 400
    r = httpx.post(main_server.base + "/responses", json={"model": "m", **body}, timeout=60)
    error = assert_responses_error(r, status, param)
    if str(body.get("input")).startswith("hello"):
        assert error["code"] == "context_length_exceeded"


def test_a_body_with_thousands_of_bad_items_gets_a_small_error(main_server: Server):
    """vllm#49239: a malformed /v1/responses request of a few kB got a ~114 MB 400 (one error per
    bad item, each echoing the input)."""
    bad = [{"role": "robot", "content": [{"type": "input_text", "text": 7}]}] * 2000  # 130 kB
    r = httpx.post(main_server.base + "/responses", json={"model": "m", "input": bad}, timeout=60)
    error = assert_responses_error(r, 400, "input[0].role")
    assert "and" in error["message"] and "more" in error["message"]  # counted, not listed


def test_not_found_wrong_method_and_bad_json_use_the_responses_shape(
    main_server: Server, client: openai.OpenAI
):
    url = main_server.base + "/responses"
    assert_responses_error(httpx.get(url + "/resp_nope"), 404)
    assert_responses_error(httpx.delete(url + "/resp_nope"), 404)
    assert_responses_error(httpx.put(url + "/resp_nope"), 405)
    assert_responses_error(httpx.get(url + "/a/b"), 404)
    bad = httpx.post(url, content=b"{not json", headers={"content-type": "application/json"})
    assert_responses_error(bad, 400)
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model="m", input=[{"role": "robot", "content": "x"}])


def test_cut_at_max_output_tokens_is_incomplete(client: openai.OpenAI):
    r = client.responses.create(model="m", input=ask("answer"), max_output_tokens=3)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output[-1].status == "incomplete" and r.usage.output_tokens == 3
    events = stream_events(client, model="m", input=ask("answer"), max_output_tokens=3)
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.output[-1].status == "incomplete"


def metric(server: Server, name: str, **labels: str) -> float:
    text = httpx.get(server.url + "/metrics").text
    total = 0.0
    for found, value in re.findall(rf"^{re.escape(name)}\{{([^}}]*)\}} (\S+)$", text, re.M):
        if all(f'{k}="{v}"' in found for k, v in labels.items()):
            total += float(value)
    return total


def test_a_client_that_goes_away_aborts_its_response(main_server: Server):
    before = metric(main_server, "sglang:num_aborted_requests_total")
    body = {"model": "m", "input": ask("long"), "stream": True}
    with httpx.stream("POST", main_server.base + "/responses", json=body, timeout=60) as r:
        for n, _ in enumerate(r.iter_lines()):
            if n >= 12:
                break  # the client goes away mid-stream

    def aborted() -> float | None:  # the aborted count, once the request is gone and counted
        stats = httpx.get(main_server.url + "/get_server_info").json()["internal_states"][0]
        count = metric(main_server, "sglang:num_aborted_requests_total")
        return count if stats["num_scripted"] == 0 and count > before else None

    assert wait_for(aborted, "the request gone and counted as aborted") == before + 1


def test_sglang_metric_names(main_server: Server, client: openai.OpenAI):
    """Each name, type and label as SGLang's observability/metrics_collector.py declares it."""
    text = httpx.get(main_server.url + "/metrics").text
    for name in ("sglang:cached_tokens", "sglang:num_aborted_requests", "sglang:num_so_requests"):
        assert f"# TYPE {name}_total counter" in text
    structured = metric(main_server, "sglang:num_so_requests_total", model_name="glm-test")
    fmt = {"format": {"type": "json_schema", "name": "a", "schema": {"type": "object"}}}
    client.responses.create(model="m", input=ask("answer"), text=fmt)
    client.responses.create(model="m", input=ask("answer"))  # no grammar: not counted
    assert metric(main_server, "sglang:num_so_requests_total") == structured + 1
    device = {"model_name": "glm-test", "cache_source": "device"}
    cached = metric(main_server, "sglang:cached_tokens_total", **device)
    prompt = "count the cached tokens of this prompt, " * 8  # the real engine, twice
    for _ in range(2):
        last = client.responses.create(model="m", input=prompt, max_output_tokens=1)
    hit = last.usage.input_tokens_details.cached_tokens
    assert hit > 0 and metric(main_server, "sglang:cached_tokens_total", **device) >= cached + hit
