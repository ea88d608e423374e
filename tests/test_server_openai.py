"""The OpenAI surface of a real `dsaserve serve` (tiny random model + scripted outputs), driven
with the official `openai` SDK: chat (streaming and not), tools, reasoning, completions, native
/generate, and the operational routes."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import openai
import pytest
from server_harness import Server, wait_for
from transformers import AutoTokenizer

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Get the weather for a location",
        "parameters": {"type": "object", "properties": {
            "location": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["location"]}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}},
    {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object",
        "properties": {"order_id": {"type": "string"}, "count": {"type": "integer"},
                       "express": {"type": "boolean"}}}}},
]  # fmt: skip


@pytest.fixture(scope="module")
def client(main_server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=main_server.base, api_key="unused", max_retries=0, timeout=120)


def ask(script: str) -> list[dict]:
    return [{"role": "user", "content": f"Please [[script:{script}]]"}]


def stream_message(client: openai.OpenAI, **kwargs) -> tuple[dict, list]:
    """Accumulate a streamed chat completion the way clients do; return it and the chunks."""
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    message = {"content": "", "reasoning_content": "", "tool_calls": {}, "finish_reason": None}
    for chunk in chunks:
        for choice in chunk.choices:
            delta = choice.delta
            message["content"] += delta.content or ""
            message["reasoning_content"] += getattr(delta, "reasoning_content", None) or ""
            for call in delta.tool_calls or []:
                slot = message["tool_calls"].setdefault(call.index, {"names": [], "args": ""})
                if call.function.name:
                    slot["names"].append(call.function.name)
                    slot["id"] = call.id
                slot["args"] += call.function.arguments or ""
            if choice.finish_reason:
                message["finish_reason"] = choice.finish_reason
    return message, chunks


def test_health_models_and_info(main_server: Server, client: openai.OpenAI):
    assert httpx.get(main_server.url + "/health").status_code == 200
    assert [m.id for m in client.models.list()] == ["glm-test"]
    info = httpx.get(main_server.url + "/get_server_info").json()
    assert info["resolved_reasoning_parser"] == "glm45"
    assert info["resolved_tool_call_parser"] == "glm47"
    assert "num_running" in info["internal_states"][0]
    assert httpx.get(main_server.url + "/health_generate", timeout=60).status_code == 200


def test_chat_real_engine(client: openai.OpenAI):
    msgs = [{"role": "user", "content": "Hello there"}]
    out = client.chat.completions.create(model="anything", messages=msgs, max_tokens=4,
                                         temperature=0.7, seed=3, n=2)  # fmt: skip
    assert out.model == "anything" and len(out.choices) == 2
    assert out.usage.completion_tokens <= 8 and out.usage.prompt_tokens > 0
    assert out.usage.prompt_tokens_details is not None  # --enable-cache-report
    again = client.chat.completions.create(model="x", messages=msgs, max_tokens=4,
                                           temperature=0.7, seed=3, n=2)  # fmt: skip
    text = lambda r: [(c.message.content, c.message.reasoning_content) for c in r.choices]  # noqa: E731
    assert text(out) == text(again)  # per-request seeds (seed + i per choice)


def test_chat_stream_shape(client: openai.OpenAI):
    chunks = list(client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Hi"}], max_tokens=3, stream=True,
        stream_options={"include_usage": True}))  # fmt: skip
    assert chunks[0].choices[0].delta.role == "assistant"
    finishes = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finishes) == 1 and finishes[0].choices[0].finish_reason in ("length", "stop")
    assert finishes[0].choices[0].delta.content is None  # the finish has its own chunk
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens >= 1


def test_continuous_usage_and_prefix_cache(client: openai.OpenAI):
    chunks = list(client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Hi"}], max_tokens=3, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}))  # fmt: skip
    counts = [c.usage.completion_tokens for c in chunks if c.usage and c.choices]
    assert counts and counts == sorted(counts)
    first = [{"role": "system", "content": "You are a careful assistant. " * 12},
             {"role": "user", "content": "First question?"}]  # fmt: skip
    client.chat.completions.create(model="m", messages=first, max_tokens=2)
    turn = first + [{"role": "assistant", "content": "An answer."},
                    {"role": "user", "content": "Second question?"}]  # fmt: skip
    out = client.chat.completions.create(model="m", messages=turn, max_tokens=2)
    assert out.usage.prompt_tokens_details.cached_tokens >= 16  # the shared prefix is reused


def test_logprobs(client: openai.OpenAI):
    out = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hi"}],
                                         max_tokens=3, logprobs=True, top_logprobs=2)  # fmt: skip
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    assert all(len(c.top_logprobs) == 2 and c.logprob <= 0 for c in content)


def test_get_weather_tool_call(client: openai.OpenAI):
    out = client.chat.completions.create(model="glm", messages=ask("weather"), tools=TOOLS)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.reasoning_content == "The user wants the weather."
    assert choice.message.content == "Let me check."
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_") and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"location": "Beijing", "days": 3}

    streamed, chunks = stream_message(client, model="glm", messages=ask("weather"), tools=TOOLS)
    assert streamed["finish_reason"] == "tool_calls"
    assert streamed["reasoning_content"] == choice.message.reasoning_content
    assert streamed["content"] == choice.message.content
    assert streamed["tool_calls"][0]["names"] == ["get_weather"]  # the name exactly once
    assert streamed["tool_calls"][0]["args"] == call.function.arguments
    last_tool = max(i for i, c in enumerate(chunks) if c.choices and c.choices[0].delta.tool_calls)
    finish = next(i for i, c in enumerate(chunks) if c.choices and c.choices[0].finish_reason)
    assert finish > last_tool and not chunks[finish].choices[0].delta.tool_calls


def test_parallel_and_zero_argument_calls(client: openai.OpenAI):
    out = client.chat.completions.create(model="m", messages=ask("parallel"), tools=TOOLS)
    calls = out.choices[0].message.tool_calls
    assert [c.function.name for c in calls] == ["get_weather", "get_time"]
    assert [json.loads(c.function.arguments) for c in calls] == [{"location": "Paris"}, {}]
    streamed, _ = stream_message(client, model="m", messages=ask("parallel"), tools=TOOLS)
    assert [streamed["tool_calls"][i]["args"] for i in (0, 1)] == [
        c.function.arguments for c in calls
    ]
    assert streamed["tool_calls"][1]["names"] == ["get_time"]


def test_values_typed_by_schema(client: openai.OpenAI):
    out = client.chat.completions.create(model="m", messages=ask("typed"), tools=TOOLS)
    args = json.loads(out.choices[0].message.tool_calls[0].function.arguments)
    assert args == {"order_id": "12345", "count": 7, "express": True}


def test_unknown_tool_dropped_and_tool_choice_none(client: openai.OpenAI):
    out = client.chat.completions.create(model="m", messages=ask("unknown"), tools=TOOLS)
    assert out.choices[0].message.tool_calls is None
    assert out.choices[0].message.content == "Done."
    assert out.choices[0].finish_reason == "stop"
    out = client.chat.completions.create(model="m", messages=ask("weather"), tools=TOOLS,
                                         tool_choice="none")  # fmt: skip
    assert out.choices[0].message.tool_calls is None
    assert "<tool_call>" not in (out.choices[0].message.content or "")
    assert out.choices[0].finish_reason == "stop"


def test_stream_reasoning_false_holds_reasoning(client: openai.OpenAI):
    chunks = list(client.chat.completions.create(
        model="m", messages=ask("answer"), stream=True,
        extra_body={"stream_reasoning": False}))  # fmt: skip
    reasoning = [
        c.choices[0].delta.reasoning_content
        for c in chunks
        if c.choices and getattr(c.choices[0].delta, "reasoning_content", None)
    ]
    assert reasoning == ["Reasoning here."]  # one delta, not streamed piece by piece


def test_stop_strings_and_named_tool_choice(client: openai.OpenAI):
    out = client.chat.completions.create(model="m", messages=ask("stopseq"), stop="STOP")
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].message.content == "count: one two"
    assert out.choices[0].model_extra["matched_stop"] == "STOP"
    named = {"type": "function", "function": {"name": "get_time"}}
    out = client.chat.completions.create(model="m", messages=ask("parallel"), tools=TOOLS,
                                         tool_choice=named)  # fmt: skip
    assert [c.function.name for c in out.choices[0].message.tool_calls] == ["get_time"]
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="m", messages=ask("parallel"), tools=TOOLS,
                                       tool_choice={"type": "function",
                                                    "function": {"name": "absent"}})  # fmt: skip


def test_answer_without_thinking_is_not_lost(client: openai.OpenAI):
    out = client.chat.completions.create(model="m", messages=ask("nothink"))
    assert out.choices[0].message.content == "Just the answer, no thinking."
    streamed, _ = stream_message(client, model="m", messages=ask("nothink"))
    assert streamed["content"] == out.choices[0].message.content


def test_reasoning_switches(client: openai.OpenAI):
    out = client.chat.completions.create(
        model="m", messages=ask("answer"),
        extra_body={"chat_template_kwargs": {"enable_thinking": True}})  # fmt: skip
    assert out.choices[0].message.reasoning_content == "Reasoning here."
    assert out.choices[0].message.content == "The answer is 42."
    raw = client.chat.completions.create(model="m", messages=ask("answer"),
                                         extra_body={"separate_reasoning": False})  # fmt: skip
    assert raw.choices[0].message.content == "Reasoning here.</think>The answer is 42."
    off = client.chat.completions.create(model="m", messages=ask("answer"),
                                         reasoning_effort="none")  # fmt: skip
    assert off.choices[0].message.reasoning_content is None  # prompt ended with </think>


def test_history_with_tool_calls(client: openai.OpenAI, server_checkpoint: Path):
    """The assistant's tool call and the tool's result reach the prompt: the server counts
    exactly the tokens of the model's own template rendered with them (dropping either turn,
    or the call's arguments, changes the count)."""
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"location": "Paris"}'},
    }
    history = [{"role": "assistant", "content": "", "tool_calls": [call]},
               {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]  # fmt: skip
    out = client.chat.completions.create(model="m", messages=ask("answer") + history,
                                         tools=TOOLS, max_tokens=2)  # fmt: skip
    tokenizer = AutoTokenizer.from_pretrained(server_checkpoint)
    rendered_call = call | {"function": call["function"] | {"arguments": {"location": "Paris"}}}
    rendered = [*ask("answer"), history[0] | {"tool_calls": [rendered_call]}, history[1]]
    prompt = tokenizer.apply_chat_template(rendered, tools=TOOLS, tokenize=False,
                                           add_generation_prompt=True)  # fmt: skip
    assert all(part in prompt for part in ("get_weather", "Paris", "sunny"))  # the turns render
    assert out.usage.prompt_tokens == len(tokenizer.encode(prompt, add_special_tokens=False))


def test_completions_and_generate(main_server: Server, client: openai.OpenAI):
    out = client.completions.create(model="m", prompt="Once upon", max_tokens=3, echo=True)
    assert out.choices[0].text.startswith("Once upon") and out.usage.completion_tokens <= 3
    chunks = list(client.completions.create(model="m", prompt=[1, 2, 3], max_tokens=3,
                                            stream=True))  # fmt: skip
    assert chunks[-1].choices[0].finish_reason in ("length", "stop")
    native = httpx.post(
        main_server.url + "/generate",
        timeout=60,
        json={"text": "Hello", "sampling_params": {"max_new_tokens": 3, "temperature": 0}},
    ).json()
    assert native["meta_info"]["completion_tokens"] == len(native["output_ids"]) <= 3
    assert native["meta_info"]["finish_reason"]["type"] in ("length", "stop")
    by_ids = httpx.post(
        main_server.url + "/generate",
        timeout=60,
        json={"input_ids": native["output_ids"] or [5], "sampling_params": {"max_new_tokens": 2}},
    )
    assert by_ids.status_code == 200


def test_metrics_flush_and_abort(main_server: Server):
    assert httpx.post(main_server.url + "/flush_cache").status_code == 200
    text = httpx.get(main_server.url + "/metrics").text
    for name in (
        "sglang:time_to_first_token_seconds",
        "sglang:num_running_reqs",
        "sglang:token_usage",
        "sglang:cache_hit_rate",
        "sglang:gen_throughput",
    ):
        assert name in text  # fmt: skip
    answer = httpx.post(main_server.url + "/abort_request", json={"rid": "nope"}).json()
    assert answer == {"aborted": []}


def _finished_by_reason(server: Server) -> dict[str, float]:
    text = httpx.get(server.url + "/metrics").text
    found = re.findall(r'sglang:num_requests_total\{[^}]*finish_reason="(\w+)"[^}]*\} (\S+)', text)
    return {reason: float(value) for reason, value in found}


def _abort_while_streaming(server: Server, rid: str, abort: dict) -> str:
    """Start the `long` script (a minute of output) as `rid`, POST `abort` once it streams, read
    to the end: its finish. A real 900-token request could finish in the engine before the abort
    arrived (its rid is out of flight once its last output reached the API process, while the
    client still reads its buffered chunks); then there was nothing to abort."""
    body = {"model": "m", "messages": ask("long"), "rid": rid, "stream": True}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as r:
        lines = filter(None, r.iter_lines())
        next(lines)
        assert httpx.post(server.url + "/abort_request", json=abort).json()["aborted"]
        chunks = [json.loads(line[6:]) for line in lines if line != "data: [DONE]"]
    reasons = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    return next(reason for reason in reasons if reason)


def test_metrics_count_client_cancels_apart(main_server: Server):
    """A client that disconnects or aborts its own rid is a `client_cancel`; the server's
    abort_all stays `abort`; neither counts as a finished request (sglang PR #32456)."""
    url = main_server.url
    before = _finished_by_reason(main_server)
    body = {"model": "m", "messages": ask("long"), "stream": True}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as r:
        for n, _ in enumerate(r.iter_lines()):
            if n >= 2:
                break  # the client goes away mid-stream (the script runs for a minute)
    assert _abort_while_streaming(main_server, "cancel-mine", {"rid": "cancel-mine"}) == "abort"
    assert _abort_while_streaming(main_server, "cancel-all", {"abort_all": True}) == "abort"
    short = body | {"max_tokens": 2, "stream": False}
    assert httpx.post(url + "/v1/chat/completions", json=short).json()["choices"][0][
        "finish_reason"] == "length"  # fmt: skip

    def counted() -> dict | None:  # each reason's growth since `before`, once both cancels are in
        after = _finished_by_reason(main_server)
        grown = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
        return grown if grown.get("client_cancel", 0) >= 2 else None

    grown = wait_for(counted, "both client cancels counted")
    assert grown.get("client_cancel") == 2, grown
    assert grown.get("abort") == 1, grown
    assert grown.get("length") == 1, grown
