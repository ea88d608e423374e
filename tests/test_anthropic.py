"""`/v1/messages` through the official `anthropic` SDK: blocks both ways, stop reasons, the SSE
event sequence, count_tokens, errors in Anthropic's envelope (field reports C21-C26, D27)."""

from __future__ import annotations

import anthropic
import httpx
import pytest
from server_harness import Server

WEATHER_TOOL = {"name": "get_weather", "description": "Weather for a city",
                "input_schema": {"type": "object", "properties": {
                    "location": {"type": "string"}, "days": {"type": "integer"}}}}  # fmt: skip


@pytest.fixture(scope="module")
def client(main_server: Server) -> anthropic.Anthropic:
    # The environment Claude Code uses: ANTHROPIC_BASE_URL plus a key (unchecked here).
    return anthropic.Anthropic(base_url=main_server.url, api_key="sk-test", max_retries=0)


def ask(script: str) -> list[dict]:
    return [{"role": "user", "content": f"go [[script:{script}]]"}]


def test_thinking_text_and_tool_use(client: anthropic.Anthropic):
    msg = client.messages.create(model="glm-5", max_tokens=200,
                                 messages=ask("weather"), tools=[WEATHER_TOOL])  # fmt: skip
    assert [b.type for b in msg.content] == ["thinking", "text", "tool_use"]
    assert msg.content[0].thinking == "The user wants the weather."
    assert msg.content[1].text == "Let me check."
    assert msg.content[2].name == "get_weather"
    assert msg.content[2].input == {"location": "Beijing", "days": 3}
    assert msg.stop_reason == "tool_use" and msg.usage.input_tokens > 0


def test_stream_matches_non_stream(client: anthropic.Anthropic):
    kwargs = {"model": "m", "max_tokens": 200, "messages": ask("weather"), "tools": [WEATHER_TOOL]}
    with client.messages.stream(**kwargs) as stream:
        events = [e.type for e in stream]
        final = stream.get_final_message()
    assert events[0] == "message_start" and events[-1] == "message_stop"
    assert "content_block_start" in events and "message_delta" in events
    whole = client.messages.create(**kwargs)
    blocks = lambda m: [b.model_dump(exclude={"id"}) for b in m.content]  # noqa: E731
    assert blocks(final) == blocks(whole)
    assert final.stop_reason == "tool_use"


def test_stop_sequence_and_end_turn(client: anthropic.Anthropic):
    msg = client.messages.create(model="m", max_tokens=100, messages=ask("stopseq"),
                                 stop_sequences=["STOP"])  # fmt: skip
    assert msg.stop_reason == "stop_sequence" and msg.stop_sequence == "STOP"
    assert msg.content[-1].text == "count: one two"
    with client.messages.stream(model="m", max_tokens=100, messages=ask("stopseq"),
                                stop_sequences=["STOP"]) as stream:  # fmt: skip
        final = stream.get_final_message()
    assert final.stop_reason == "stop_sequence"
    msg = client.messages.create(model="m", max_tokens=100, messages=ask("answer"))
    assert msg.stop_reason == "end_turn"
    assert [b.type for b in msg.content] == ["thinking", "text"]
    msg = client.messages.create(model="m", max_tokens=2, messages=ask("long"))
    assert msg.stop_reason == "max_tokens" and msg.usage.output_tokens == 2


def test_history_blocks_system_and_count_tokens(client: anthropic.Anthropic):
    history = [
        {"role": "user", "content": "weather in Paris?"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "I should call the tool.", "signature": ""},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
             "input": {"location": "Paris"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
            {"type": "text", "text": "thanks [[script:answer]]"}]},
        {"role": "system", "content": "Be brief."},
    ]  # fmt: skip
    system = [
        {"type": "text", "text": "x-anthropic-billing-header: cch=123;"},
        {"type": "text", "text": "You are helpful.", "cache_control": {"type": "ephemeral"}},
    ]
    msg = client.messages.create(model="m", max_tokens=50, system=system, messages=history,
                                 tools=[WEATHER_TOOL], thinking={"type": "enabled",
                                 "budget_tokens": 1024})  # fmt: skip
    assert msg.content[-1].text == "The answer is 42."
    count = client.messages.count_tokens(model="m", system=system, messages=history,
                                         tools=[WEATHER_TOOL]).input_tokens  # fmt: skip
    other = [{"type": "text", "text": "x-anthropic-billing-header: cch=999;"}, system[1]]
    assert count == client.messages.count_tokens(model="m", system=other, messages=history,
                                                 tools=[WEATHER_TOOL]).input_tokens  # fmt: skip
    assert count > msg.usage.output_tokens


def test_errors_use_the_anthropic_envelope(main_server: Server, client: anthropic.Anthropic):
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(model="m", max_tokens=0, messages=ask("answer"))
    r = httpx.post(main_server.url + "/v1/messages", json={"model": "m", "messages": []})
    body = r.json()
    assert r.status_code == 400 and body["type"] == "error"
    assert body["error"]["type"] == "invalid_request_error"
    r = httpx.post(main_server.url + "/v1/messages", content=b"{not json",
                   headers={"content-type": "application/json"})  # fmt: skip
    assert r.status_code == 400 and r.json()["type"] == "error"
    bad = {"model": "m", "max_tokens": 5, "messages": [{"role": "assistant", "content": [
        {"type": "redacted_thinking", "data": "x"}]}]}  # fmt: skip
    r = httpx.post(main_server.url + "/v1/messages", json=bad)
    assert r.status_code == 400 and "redacted_thinking" in r.json()["error"]["message"]


def test_concurrent_thinking_streams(client: anthropic.Anthropic):
    """Thinking blocks close in a form the SDK accepts, with several cold streams at once (C23)."""
    from concurrent.futures import ThreadPoolExecutor

    def one(_: int) -> list[str]:
        with client.messages.stream(model="m", max_tokens=100, messages=ask("answer")) as s:
            return [b.type for b in s.get_final_message().content]

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(one, range(4)))
    assert results == [["thinking", "text"]] * 4


def test_moving_cache_control_keeps_the_prefix_cached(client: anthropic.Anthropic):
    """Claude Code moves cache_control breakpoints every turn; the prompt must not change (D28)."""
    system = "You are a coding agent. " * 12

    def turn(marked: int) -> anthropic.types.Message:
        blocks = [{"type": "text", "text": t} for t in ("first", "second")]
        blocks[marked]["cache_control"] = {"type": "ephemeral"}
        return client.messages.create(model="m", max_tokens=1, system=system,
                                      messages=[{"role": "user", "content": blocks}])  # fmt: skip

    first, second = turn(0), turn(1)
    total = lambda m: m.usage.input_tokens + m.usage.cache_read_input_tokens  # noqa: E731
    assert total(first) == total(second)
    assert second.usage.cache_read_input_tokens >= 16
