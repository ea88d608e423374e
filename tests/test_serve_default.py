"""The README's first command: `dsaserve serve` with no --model-path serves the embedded model
(tests/conftest.py's `readme_server`: the console script as the README writes it, with only
`--port 0` added), the README's curl body gets the answer the README prints, and the README's
examples (the guide's 15% of 240 and weather in Paris) give the expected kind of answer through
the official openai SDK, greedy."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import httpx
import jsonschema
import pytest
from openai import OpenAI
from server_harness import readme_block

from dsaserve.assets import default_model_path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from default_model_data import WEATHER_TOOL  # noqa: E402  (the schema the model was trained on)


@pytest.fixture(scope="module")
def server(readme_server):
    return readme_server


@pytest.fixture(scope="module")
def client(server) -> OpenAI:
    return OpenAI(base_url=server.base, api_key="none")


def test_dsaserve_serve_without_a_model_path_serves_the_embedded_model(server):
    models = httpx.get(f"{server.url}/v1/models", timeout=30).json()
    assert models["data"][0]["id"] == default_model_path().name


def test_the_readmes_curl_gets_the_answer_the_readme_prints(server):
    """The README's curl line, sent as written (its path and body), answers what the README's
    comment lines print: the content exactly, the reasoning up to the README's `...`."""
    curl = readme_block("## Talk to it")
    path = re.search(r"localhost:30000(/\S+)", curl).group(1)
    body = json.loads(re.search(r"-d '(.*?)'", curl, re.S).group(1))
    printed = dict(re.findall(r'^# "(\w+)": "(.*)"$', curl, re.M))
    reply = httpx.post(server.url + path, json=body, timeout=300)  # hang guard
    assert reply.status_code == 200, reply.text
    message = reply.json()["choices"][0]["message"]
    assert message["content"] == printed["content"], message
    assert message["reasoning_content"].startswith(printed["reasoning_content"].split(" ...")[0])


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


def test_ci_runs_exactly_the_readmes_test_command():
    """`.ci/run` installs, then runs the README's test command as written (its last line)."""
    command = readme_block("Run the tests")
    ci = (Path(__file__).resolve().parents[1] / ".ci" / "run").read_text().strip().splitlines()
    assert ci[-1] == command
    assert "scripts/install.sh" in ci
