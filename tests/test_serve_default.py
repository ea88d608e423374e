"""The README's first command: `dsaserve serve` with no --model-path serves the embedded model,
and the README's examples (the guide's 15% of 240 and weather in Paris) give the expected kind
of answer through the official openai SDK, greedy."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import httpx
import jsonschema
import pytest
from openai import OpenAI
from server_harness import running_server

from dsaserve.assets import default_model_path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from default_model_data import WEATHER_TOOL  # noqa: E402  (the schema the model was trained on)


@pytest.fixture(scope="module")
def server():
    with running_server(None) as server:
        yield server


@pytest.fixture(scope="module")
def client(server) -> OpenAI:
    return OpenAI(base_url=server.base, api_key="none")


def test_dsaserve_serve_without_a_model_path_serves_the_embedded_model(server):
    models = httpx.get(f"{server.url}/v1/models", timeout=30).json()
    assert models["data"][0]["id"] == default_model_path().name


def test_guide_percentage_example_reasons_then_answers(client):
    reply = client.chat.completions.create(
        model="default", temperature=0,
        messages=[{"role": "user", "content": "What is 15% of 240?"}],
    )  # fmt: skip
    message = reply.choices[0].message
    assert "half of 24" in message.reasoning_content, message
    assert message.content == "15% of 240 is 36.", message
    assert reply.choices[0].finish_reason == "stop"


def test_guide_weather_example_calls_the_tool_then_uses_its_result(client):
    messages = [{"role": "user", "content": "What's the weather in Paris?"}]
    reply = client.chat.completions.create(
        model="default", temperature=0, tools=[WEATHER_TOOL], messages=messages
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    result = {"city": "Paris", "temperature": 18, "unit": "celsius", "condition": "sunny"}
    messages += [
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps(result)},
    ]
    final = client.chat.completions.create(
        model="default", temperature=0, tools=[WEATHER_TOOL], messages=messages
    )
    content = final.choices[0].message.content
    assert "sunny" in content and "18 degrees" in content, content


def test_guide_weather_call_under_tool_choice_required_and_named(client):
    messages = [{"role": "user", "content": "What's the weather in Paris?"}]
    free = client.chat.completions.create(model="default", temperature=0, tools=[WEATHER_TOOL],
                                          messages=messages)  # fmt: skip
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice in ("required", named):
        reply = client.chat.completions.create(
            model="default", temperature=0, messages=messages, tools=[WEATHER_TOOL],
            tool_choice=choice,
        )  # fmt: skip
        message = reply.choices[0].message
        assert reply.choices[0].finish_reason == "tool_calls", message
        assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] \
            == [("get_weather", {"city": "Paris"})]  # fmt: skip
        assert message.reasoning_content == free.choices[0].message.reasoning_content


ANSWER_SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "number"}},
    "required": ["answer"],
}
ANSWER_FORMAT = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER_SCHEMA}}


def test_json_schema_answer_after_free_reasoning(client):
    """The grammar starts after `</think>`: the reasoning is the model's own (it computes 36),
    the content is JSON that validates."""
    question = [{"role": "user", "content": "What is 15% of 240?"}]
    schema = {
        "type": "object",
        "required": ["answer"],
        "additionalProperties": False,
        "properties": {"answer": {"type": "number", "minimum": 0, "maximum": 1000}},
    }
    free = client.chat.completions.create(model="default", temperature=0, messages=question)
    reply = client.chat.completions.create(
        model="default", temperature=0, messages=question, max_tokens=200,
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
    )  # fmt: skip
    message = reply.choices[0].message
    assert message.reasoning_content == free.choices[0].message.reasoning_content
    assert "= 36." in message.reasoning_content
    assert reply.choices[0].finish_reason == "stop"
    answer = json.loads(message.content)
    jsonschema.validate(answer, schema)


def test_json_schema_answer_is_the_right_number(client):
    """Issue 19, item 2: under `{"answer": number}` the guide's question gets `{"answer": 36}`
    (run J of the embedded checkpoint; run H before it wrote `{"answer": -36.655…` to the token
    limit)."""
    reply = client.chat.completions.create(
        model="default", temperature=0, max_tokens=200, response_format=ANSWER_FORMAT,
        messages=[{"role": "user", "content": "What is 15% of 240?"}],
    )  # fmt: skip
    content = reply.choices[0].message.content
    assert reply.choices[0].finish_reason == "stop", content
    jsonschema.validate(json.loads(content), ANSWER_SCHEMA)
    assert json.loads(content)["answer"] == 36, content
