"""Structured output through a real `dsaserve serve` and the official SDKs, on a random model
whose unconstrained output is noise: every answer parses and validates against its schema
(a table of schemas; thinking on and off; streaming and not; several seeds), regex and EBNF on
`/generate`, tool_choice "required" / named / strict tools give calls that validate, bad
grammars are a 400 naming the field, and the cache report is on by default.

Thinking on: a random model never closes `<think>` by chance, so the checkpoint here has the
lm_head rows of `</think>` and of the third token the model writes greedily for PROMPT swapped:
it writes two reasoning tokens, then `</think>`, then (constrained) the answer.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import anthropic
import httpx
import jsonschema
import openai
import pytest
from safetensors.torch import load_file, save_file
from server_harness import Server, running_server
from test_server_openai import stream_message

from dsaserve import LLM, SamplingParams

PROMPT = [{"role": "user", "content": "Reply with the record as JSON, please."}]
S, I = "string", "integer"  # noqa: E741
SCHEMAS = {
    "nested": {"type": "object", "properties": {
        "user": {"type": "object", "properties": {"name": {"type": S, "maxLength": 8},
                                                  "id": {"type": I, "minimum": 0, "maximum": 999}},
                 "required": ["name", "id"]}}, "required": ["user"]},
    "array_bounds": {"type": "object", "properties": {"tags": {
        "type": "array", "items": {"type": S, "maxLength": 5}, "minItems": 2, "maxItems": 4}},
        "required": ["tags"]},
    "enums": {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                               "size": {"type": S, "enum": ["S", "M", "L"]}},
              "required": ["color", "size"]},
    "number_ranges": {"type": "object", "properties": {
        "t": {"type": "number", "minimum": -10, "maximum": 40},
        "n": {"type": I, "exclusiveMinimum": 0, "maximum": 5}}, "required": ["t", "n"]},
    "any_of": {"type": "object", "properties": {"v": {"anyOf": [
        {"type": I, "minimum": 0, "maximum": 99}, {"type": S, "maxLength": 6},
        {"type": "boolean"}]}}, "required": ["v"]},
    "optional": {"type": "object", "properties": {
        "a": {"type": I, "minimum": 0, "maximum": 9}, "b": {"type": S, "maxLength": 4},
        "c": {"type": "boolean"}}, "required": ["a"], "additionalProperties": False},
    "patterns": {"type": "object", "properties": {
        "code": {"type": S, "pattern": "^[A-Z]{3}-[0-9]{2}$"},
        "month": {"type": S, "pattern": "^20[0-9]{2}-(0[1-9]|1[0-2])$"}},
        "required": ["code", "month"]},
}  # fmt: skip
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": S, "maxLength": 12},
                "days": {"type": I, "minimum": 1, "maximum": 7},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
        },
    },
}
LOOKUP = {
    "type": "function",
    "function": {
        "name": "lookup",
        "strict": True,
        "parameters": {
            "type": "object",
            "properties": {
                "order_id": {"type": S, "pattern": "^[0-9]{5}$"},
                "items": {
                    "type": "array",
                    "items": {"type": I, "minimum": 0, "maximum": 9},
                    "maxItems": 3,
                },
            },
            "required": ["order_id", "items"],
        },
    },
}
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}
THINK = {"chat_template_kwargs": {"enable_thinking": True}}


STRICT = [dict(WEATHER, function=dict(WEATHER["function"], strict=True)), LOOKUP]
GO = [{"role": "user", "content": "Go"}]


def swap_head_rows(folder: Path, a: int, b: int) -> None:
    tensors = load_file(str(folder / "model.safetensors"))
    head = tensors["lm_head.weight"]
    head[[a, b]] = head[[b, a]]
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})


def greedy_ids(folder: Path, messages: list[dict], count: int, **template) -> list[int]:
    llm = LLM(str(folder), max_total_tokens=2048, page_size=16)
    prompt = llm.tokenizer.apply_chat_template(messages, tokenize=False,
                                               add_generation_prompt=True, **template)  # fmt: skip
    out = llm.generate([prompt], SamplingParams(max_tokens=count, temperature=0), use_tqdm=False)
    ids = {t: llm.tokenizer.convert_tokens_to_ids(t) for t in ("</think>", "<tool_call>")}
    del llm
    return out[0].token_ids, ids


@pytest.fixture(scope="module")
def checkpoint(server_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The random model, with two pairs of lm_head rows swapped so that greedily it writes two
    reasoning tokens then `</think>` for PROMPT, and opens `<tool_call>` at once for GO with the
    STRICT tools (so the strict-tool tests see calls to check, not only text)."""
    folder = tmp_path_factory.mktemp("structured") / "ckpt"
    shutil.copytree(server_checkpoint, folder)
    out, ids = greedy_ids(folder, PROMPT, 3, enable_thinking=True)
    swap_head_rows(folder, out[2], ids["</think>"])
    out, _ = greedy_ids(folder, GO, 1, tools=STRICT, enable_thinking=False)
    swap_head_rows(folder, out[0], ids["<tool_call>"])
    assert greedy_ids(folder, PROMPT, 3, enable_thinking=True)[0][2] == ids["</think>"]
    assert greedy_ids(folder, GO, 1, tools=STRICT, enable_thinking=False)[0] == [ids["<tool_call>"]]
    return folder


@pytest.fixture(scope="module")
def server(checkpoint: Path):
    with running_server(checkpoint, "--served-model-name", "glm-test") as server:
        yield server


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base, api_key="x", max_retries=0, timeout=120)


def schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "r", "schema": schema, "strict": True}}


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_every_answer_validates(client: openai.OpenAI, name: str):
    schema, fmt = SCHEMAS[name], schema_format(SCHEMAS[name])
    sampled = client.chat.completions.create(model="m", messages=PROMPT, max_tokens=120, n=3,
                                             temperature=1.0, seed=7, response_format=fmt,
                                             extra_body=NO_THINK)  # fmt: skip
    answers = [(c.message.content, c.finish_reason) for c in sampled.choices]
    for thinking in (NO_THINK, THINK):
        kwargs = dict(model="m", messages=PROMPT, max_tokens=120, temperature=0,
                      response_format=fmt, extra_body=thinking)  # fmt: skip
        full = client.chat.completions.create(**kwargs).choices[0]
        streamed, _ = stream_message(client, **kwargs)
        assert streamed["content"] == full.message.content
        answers += [(full.message.content, full.finish_reason)]
        if thinking is THINK:
            assert full.message.reasoning_content  # thinking stayed free, the JSON is content
            assert streamed["reasoning_content"] == full.message.reasoning_content
    for content, finish in answers:
        assert finish == "stop", content
        jsonschema.validate(json.loads(content), schema)


def test_json_object_and_unconstrained_noise(client: openai.OpenAI):
    # json_object bounds nothing (a random model writes long keys): greedy, with room to finish
    kwargs = dict(model="m", messages=PROMPT, max_tokens=200, temperature=0,
                  response_format={"type": "json_object"}, extra_body=NO_THINK)  # fmt: skip
    out = client.chat.completions.create(**kwargs).choices[0]
    assert out.finish_reason == "stop"
    assert isinstance(json.loads(out.message.content), dict)
    assert stream_message(client, **kwargs)[0]["content"] == out.message.content
    free = client.chat.completions.create(model="m", messages=PROMPT, max_tokens=30,
                                          temperature=0, extra_body=NO_THINK)  # fmt: skip
    with pytest.raises(ValueError):
        json.loads(free.choices[0].message.content)


def test_regex_and_ebnf_on_generate(server: Server):
    cases = [
        ("regex", r"(yes|no): [a-z]{2,6}, [0-9]{1,3}", r"(yes|no): [a-z]{2,6}, [0-9]{1,3}"),
        (
            "regex",
            r"[A-Z][a-z]{1,8}( [A-Z][a-z]{1,8}){0,2}\.",
            r"[A-Z][a-z]{1,8}( [A-Z][a-z]{1,8}){0,2}\.",
        ),
        (
            "ebnf",
            'root ::= "(" num (op num){0,3} ")"\nnum ::= [1-9] [0-9]{0,2}\nop ::= " + " | " * "',
            r"\([1-9][0-9]{0,2}(( \+ | \* )[1-9][0-9]{0,2}){0,3}\)",
        ),
    ]
    for kind, grammar, check in cases:
        for seed in range(3):
            body = {
                "text": "Say something:",
                "sampling_params": {
                    "max_new_tokens": 60,
                    "temperature": 1.0,
                    "seed": seed,
                    kind: grammar,
                },
            }
            answer = httpx.post(server.url + "/generate", json=body, timeout=120).json()
            assert re.fullmatch(check, answer["text"]), (kind, answer)
            assert answer["meta_info"]["finish_reason"]["type"] == "stop"


def calls_of(message, cut: bool = False) -> list[tuple[str, dict]]:
    """The message's calls, parsed; `cut`: the answer hit max_tokens, so its last call may be
    cut (its arguments are then not JSON): left out."""
    calls = message.tool_calls or []
    if cut and calls:
        try:
            json.loads(calls[-1].function.arguments)
        except ValueError:
            calls = calls[:-1]
    return [(c.function.name, json.loads(c.function.arguments)) for c in calls]


def validate_calls(calls: list[tuple[str, dict]], tools: list[dict]) -> None:
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    for name, arguments in calls:
        jsonschema.validate(arguments, schemas[name])


def test_tool_choice_required_and_named_calls_validate(client: openai.OpenAI):
    tools, ask = [WEATHER, LOOKUP], [{"role": "user", "content": "Do something useful."}]
    for choice in ("required", {"type": "function", "function": {"name": "lookup"}}):
        kwargs = dict(model="m", messages=ask, tools=tools, tool_choice=choice, seed=3,
                      temperature=1.0, max_tokens=150, parallel_tool_calls=False,
                      extra_body=NO_THINK)  # fmt: skip
        out = client.chat.completions.create(n=4, **kwargs)
        for c in out.choices:
            calls = calls_of(c.message)
            assert c.finish_reason == "tool_calls" and len(calls) == 1, c
            assert isinstance(choice, str) or calls[0][0] == "lookup"
            validate_calls(calls, tools)
        streamed, _ = stream_message(client, **kwargs)
        assert streamed["finish_reason"] == "tool_calls"
        first = calls_of(out.choices[0].message)
        assert [json.loads(s["args"]) for s in streamed["tool_calls"].values()] == [
            a for _, a in first
        ]
    # parallel calls: back to back until the model stops (a random one may not: max_tokens cuts
    # the last call, every complete one validates)
    out = client.chat.completions.create(model="m", messages=ask, tools=tools, n=3, seed=4,
                                         tool_choice="required", temperature=1.0, max_tokens=120,
                                         extra_body=NO_THINK)  # fmt: skip
    for c in out.choices:
        assert c.message.tool_calls and c.message.content is None
        assert c.finish_reason in ("tool_calls", "length")
        validate_calls(calls_of(c.message, cut=c.finish_reason == "length"), tools)


def test_strict_tools_validate_when_called(client: openai.OpenAI):
    """Strict tools under "auto": the model may write text, and a call it opens is constrained
    by its tool's schema. Greedily this model opens a call at once (see `checkpoint`), so there
    is a call to check; sampled choices may write text, or calls that validate."""
    greedy = client.chat.completions.create(model="m", messages=GO, tools=STRICT, max_tokens=80,
                                            temperature=0, extra_body=NO_THINK)  # fmt: skip
    finish = greedy.choices[0].finish_reason
    calls = calls_of(greedy.choices[0].message, cut=finish == "length")
    assert calls and finish in ("tool_calls", "length"), greedy  # a whole call, to validate
    validate_calls(calls, STRICT)
    out = client.chat.completions.create(model="m", messages=GO, tools=STRICT, n=6, seed=5,
                                         temperature=1.0, max_tokens=80,
                                         extra_body=NO_THINK)  # fmt: skip
    for choice in out.choices:
        calls = calls_of(choice.message, cut=choice.finish_reason == "length")
        validate_calls(calls, STRICT)  # text, or calls that validate


def test_uncompilable_grammars_are_400_naming_the_field(client: openai.OpenAI, server: Server):
    bad = schema_format({"type": "object", "properties": {"a": {"type": "strin"}}})
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="m", messages=PROMPT, response_format=bad)
    assert e.value.body["param"] == "response_format.json_schema.schema"
    assert "strin" in e.value.body["message"]
    for kind, grammar in (("regex", "(unclosed"), ("ebnf", "root ::= missing_rule")):
        body = {"text": "x", "sampling_params": {"max_new_tokens": 4, kind: grammar}}
        reply = httpx.post(server.url + "/generate", json=body, timeout=60)
        assert reply.status_code == 400 and reply.json()["error"]["param"] == (
            f"sampling_params.{kind}"
        ), reply.text
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="m", messages=PROMPT, tools=[WEATHER],
                                       tool_choice="required",
                                       response_format={"type": "json_object"})  # fmt: skip
    assert e.value.body["param"] == "response_format"


def test_cache_report_is_on_by_default(client: openai.OpenAI, server: Server):
    long = [{"role": "system", "content": "You answer questions about records. " * 8}, *PROMPT]
    for _ in range(2):
        out = client.chat.completions.create(model="m", messages=long, max_tokens=2)
    assert out.usage.prompt_tokens_details.cached_tokens >= 16
    claude = anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0)
    for _ in range(2):
        reply = claude.messages.create(model="m", max_tokens=2, system=long[0]["content"],
                                       messages=[{"role": "user", "content": "hi"}])  # fmt: skip
    assert reply.usage.cache_read_input_tokens >= 16


@pytest.fixture(scope="module")
def llguidance_client(checkpoint: Path):
    with running_server(checkpoint, "--served-model-name", "glm-test",
                        "--grammar-backend", "llguidance") as server:  # fmt: skip
        yield openai.OpenAI(base_url=server.base, api_key="x", max_retries=0, timeout=120)


def test_llguidance_tool_calls_validate(llguidance_client: openai.OpenAI):
    """`--grammar-backend llguidance` builds the same tool-call grammars (as Lark): forced,
    named and strict calls validate, streaming included."""
    test_tool_choice_required_and_named_calls_validate(llguidance_client)
    test_strict_tools_validate_when_called(llguidance_client)
