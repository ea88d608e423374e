"""DeepSeek-V3.2 served end to end: a tiny random DeepseekV32ForCausalLM with DeepSeek's tokens
and no chat template, behind a real `dsaserve serve` (real engine plus scripted outputs), driven
with the official `openai` and `anthropic` SDKs: thinking on and off, DSML tool calls with typed
arguments, streaming identical to non-streaming, `tool_choice` none, and `tool_choice`
named / required constrained by the DSML grammar on the real model."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import jsonschema
import openai
import pytest
from deepseek_checkpoint import make_deepseek_server_checkpoint
from server_harness import Server, running_server, write_scripts
from test_server_openai import stream_message
from transformers import AutoTokenizer

from dsaserve.server.templates import deepseek_v32

D = "｜DSML｜"
CALL = (f'\n\n<{D}function_calls>\n<{D}invoke name="get_weather">\n'
        f'<{D}parameter name="location" string="true">Beijing</{D}parameter>\n'
        f'<{D}parameter name="days" string="false">3</{D}parameter>\n'
        f"</{D}invoke>\n</{D}function_calls>")  # fmt: skip
SCRIPTS = {
    "think_tool": {"text": "The user wants the weather.</think>Let me check." + CALL, "chunk": 3},
    "answer": {"text": "Reasoning here.</think>The answer is 42.", "chunk": 4},
    "bare": {"text": f'Checking.\n\n<{D}invoke name="get_weather">\n<{D}parameter '
                     f'name="location" string="true">Oslo', "chunk": 2},
}  # fmt: skip
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get the weather for a location",
    "parameters": {"type": "object", "properties": {
        "location": {"type": "string"}, "days": {"type": "integer"}}}}}]  # fmt: skip
WEATHER = {"location": "Beijing", "days": 3}
THINKING = {"chat_template_kwargs": {"thinking": True}}


@pytest.fixture(scope="module")
def deepseek_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Path]]:
    folder = make_deepseek_server_checkpoint(tmp_path_factory.mktemp("ds_ckpt"), 2048)
    scripts = write_scripts(tmp_path_factory.mktemp("ds_scripts"), SCRIPTS)
    with running_server(folder, "--served-model-name", "ds-test", scripts=scripts) as server:
        yield server, folder


@pytest.fixture(scope="module")
def client(deepseek_server: tuple[Server, Path]) -> openai.OpenAI:
    base = deepseek_server[0].base
    return openai.OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def claude(deepseek_server: tuple[Server, Path]) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=deepseek_server[0].url, api_key="k", max_retries=0)


def ask(script: str) -> list[dict]:
    return [{"role": "user", "content": f"Please [[script:{script}]]"}]


def both(client: openai.OpenAI, **kwargs) -> tuple[dict, dict]:
    """The non-streamed message and the accumulated stream, in one shape."""
    out = client.chat.completions.create(**kwargs).choices[0]
    message = out.message
    calls = {i: {"names": [c.function.name], "args": c.function.arguments, "id": c.id}
             for i, c in enumerate(message.tool_calls or [])}  # fmt: skip
    whole = {"content": message.content or "", "finish_reason": out.finish_reason,
             "reasoning_content": getattr(message, "reasoning_content", None) or "",
             "tool_calls": calls}  # fmt: skip
    streamed, _ = stream_message(client, **kwargs)
    for call in [*whole["tool_calls"].values(), *streamed["tool_calls"].values()]:
        call.pop("id")  # fresh per response
    return whole, streamed


def test_served_with_the_builtin_encoder(deepseek_server: tuple[Server, Path], client):
    server, folder = deepseek_server
    info = httpx.get(server.url + "/get_server_info").json()
    assert info["resolved_reasoning_parser"] == "deepseek-v3"
    assert info["resolved_tool_call_parser"] == "deepseekv32"
    messages = [{"role": "user", "content": "Hello there"}]
    out = client.chat.completions.create(model="m", messages=messages, max_tokens=4,
                                         extra_body=THINKING)  # fmt: skip
    tokenizer = AutoTokenizer.from_pretrained(folder)
    prompt = deepseek_v32.render_chat(messages, None, thinking=True)
    assert prompt.endswith("<｜User｜>Hello there<｜Assistant｜><think>")
    assert out.usage.prompt_tokens == len(tokenizer.encode(prompt, add_special_tokens=False))
    assert out.usage.completion_tokens <= 4  # the random model generated for real


def test_thinking_on_tool_call_with_typed_arguments(client: openai.OpenAI):
    whole, streamed = both(client, model="m", messages=ask("think_tool"), tools=TOOLS,
                           extra_body=THINKING)  # fmt: skip
    assert whole == streamed
    assert whole["reasoning_content"] == "The user wants the weather."
    assert whole["content"] == "Let me check."
    assert whole["finish_reason"] == "tool_calls"
    assert [c["names"] for c in whole["tool_calls"].values()] == [["get_weather"]]
    assert json.loads(whole["tool_calls"][0]["args"]) == WEATHER


def test_thinking_off_is_all_content(client: openai.OpenAI):
    on, on_streamed = both(client, model="m", messages=ask("answer"), extra_body=THINKING)
    assert on == on_streamed
    assert (on["reasoning_content"], on["content"]) == ("Reasoning here.", "The answer is 42.")
    off, off_streamed = both(client, model="m", messages=ask("answer"))
    assert off == off_streamed
    assert off["reasoning_content"] == ""
    assert off["content"] == "Reasoning here.</think>The answer is 42."


def test_malformed_call_and_tool_choice_none(client: openai.OpenAI):
    whole, streamed = both(client, model="m", messages=ask("bare"), tools=TOOLS)
    assert whole == streamed
    assert whole["finish_reason"] == "tool_calls" and whole["content"] == "Checking."
    assert json.loads(whole["tool_calls"][0]["args"]) == {"location": "Oslo"}
    none, none_streamed = both(client, model="m", messages=ask("think_tool"), tools=TOOLS,
                               tool_choice="none", extra_body=THINKING)  # fmt: skip
    assert none == none_streamed
    assert none["tool_calls"] == {} and none["finish_reason"] == "stop"
    assert none["content"] == "Let me check."  # no DSML markup leaks (sglang#35736)


BOUNDED = [{"type": "function", "function": {"name": name, "parameters": {
    "type": "object", "required": ["location"], "properties": {
        "location": {"type": "string", "maxLength": 6},
        "days": {"type": "integer", "minimum": 1, "maximum": 9}}}}}
    for name in ("get_weather", "get_rain")]  # fmt: skip


def test_tool_choice_named_and_required_constrain_the_real_model(client: openai.OpenAI):
    """The DSML grammar makes the random model write a complete call that validates. Thinking is
    off: with it on the grammar starts after `</think>`, which a random model need never write
    (the trigger itself is tested on a model in test_grammar.py), so every choice is checked."""
    schema = BOUNDED[0]["function"]["parameters"]
    named = {"type": "function", "function": {"name": "get_rain"}}
    for choice in (named, "required"):
        out = client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "Weather?"}], tools=BOUNDED,
            tool_choice=choice, max_tokens=300, temperature=1.0, seed=7, n=3,
            parallel_tool_calls=False,
        )  # fmt: skip
        assert len(out.choices) == 3
        for c in out.choices:
            calls = c.message.tool_calls
            assert c.finish_reason == "tool_calls" and calls and len(calls) == 1, c
            assert choice == "required" or calls[0].function.name == "get_rain"
            jsonschema.validate(json.loads(calls[0].function.arguments), schema)


def test_anthropic_thinking_tool_use_and_stream(claude: anthropic.Anthropic):
    tool = {"name": "get_weather", "input_schema": TOOLS[0]["function"]["parameters"]}
    kwargs = {"model": "m", "max_tokens": 300, "messages": ask("think_tool"), "tools": [tool],
              "thinking": {"type": "enabled", "budget_tokens": 1024}}  # fmt: skip
    msg = claude.messages.create(**kwargs)
    assert [b.type for b in msg.content] == ["thinking", "text", "tool_use"]
    assert msg.content[0].thinking == "The user wants the weather."
    assert (msg.content[2].name, msg.content[2].input) == ("get_weather", WEATHER)
    assert msg.stop_reason == "tool_use"
    with claude.messages.stream(**kwargs) as stream:
        final = stream.get_final_message()
    blocks = lambda m: [b.model_dump(exclude={"id"}) for b in m.content]  # noqa: E731
    assert blocks(final) == blocks(msg)
    off = claude.messages.create(model="m", max_tokens=300, messages=ask("answer"),
                                 thinking={"type": "disabled"})  # fmt: skip
    assert [b.type for b in off.content] == ["text"]
    assert off.content[0].text == "Reasoning here.</think>The answer is 42."
    bounded = {"name": "get_weather", "input_schema": BOUNDED[0]["function"]["parameters"]}
    forced = claude.messages.create(
        model="m", max_tokens=300, tools=[bounded],
        tool_choice={"type": "tool", "name": "get_weather"},
        messages=[{"role": "user", "content": "Weather?"}],
    )  # fmt: skip
    assert forced.content[-1].type == "tool_use" and forced.content[-1].name == "get_weather"
    assert forced.stop_reason == "tool_use"
    jsonschema.validate(forced.content[-1].input, bounded["input_schema"])


def test_responses_thinking_tool_call_and_its_round_trip(client: openai.OpenAI):
    """`/v1/responses` on DeepSeek-V3.2: `reasoning.effort` turns thinking on, the DSML call is a
    `function_call` item with typed arguments (streamed or not), and the round trip renders
    through the built-in encoder as the chat route renders it."""
    tool = {"type": "function", **TOOLS[0]["function"]}
    kwargs = {"model": "m", "input": ask("think_tool"), "tools": [tool],
              "reasoning": {"effort": "high", "summary": "auto"}}  # fmt: skip
    whole = client.responses.create(**kwargs)
    assert [o.type for o in whole.output] == ["reasoning", "message", "function_call"]
    assert whole.output[0].summary[0].text == "The user wants the weather."
    call = whole.output[2]
    assert whole.output_text == "Let me check." and call.name == "get_weather"
    assert json.loads(call.arguments) == WEATHER
    with client.responses.stream(**kwargs) as stream:
        streamed = stream.get_final_response()
    shape = lambda r: [o.model_dump(exclude={"id", "call_id", "parsed"}, exclude_none=True)  # noqa: E731
                       for o in r.output]  # fmt: skip
    assert shape(streamed) == shape(whole)
    off = client.responses.create(model="m", input=ask("answer"))  # thinking is off by default
    assert [o.type for o in off.output] == ["message"]
    assert off.output_text == "Reasoning here.</think>The answer is 42."
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}
    history = [*ask("think_tool"), *[o.model_dump(exclude_none=True) for o in whole.output],
               result, *ask("answer")]  # fmt: skip
    second = client.responses.create(model="m", input=history, tools=[tool],
                                     reasoning={"effort": "high"})  # fmt: skip
    assert second.output_text == "The answer is 42."
    function = {"name": call.name, "arguments": call.arguments}
    calls = [{"id": call.call_id, "type": "function", "function": function}]
    assistant = {"role": "assistant", "content": "Let me check.", "tool_calls": calls,
                 "reasoning_content": "The user wants the weather."}  # fmt: skip
    tool_result = {"role": "tool", "tool_call_id": call.call_id, "content": "sunny"}
    messages = [*ask("think_tool"), assistant, tool_result, *ask("answer")]
    chat = client.chat.completions.create(model="m", messages=messages, tools=TOOLS,
                                          extra_body=THINKING)  # fmt: skip
    assert chat.usage.prompt_tokens == second.usage.input_tokens
