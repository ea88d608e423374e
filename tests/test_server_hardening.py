"""Issue 12: no request can hurt the server. One regression test per input the hostile-client
report listed: engine killers, unbounded work, 500s for bad input, ghost rids, values accepted
silently, and the HTTP edges. Each answer must be the API's own error shape naming the field, the
engine must survive, and the stats must come back to idle."""

from __future__ import annotations

import json

import httpx
import pytest
from server_harness import CONTEXT_LENGTH, Server, wait_for

JSON = {"content-type": "application/json"}
USER = [{"role": "user", "content": "hi"}]


def post(server: Server, path: str, body: dict, timeout: float = 60) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=timeout)


def assert_openai_error(r: httpx.Response, status: int, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    assert len(r.content) < 4000
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"], error
    if param is not None:
        assert (error["param"] or "").startswith(param), error
    return error


def assert_anthropic_error(r: httpx.Response, status: int = 400) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error", body
    return body["error"]


def engine_pid(server: Server) -> int:
    return httpx.get(server.url + "/get_server_info").json()["engine_pid"]


def assert_serving(server: Server, pid: int) -> None:
    """The same engine process still serves a fresh request."""
    assert httpx.get(server.url + "/health").status_code == 200
    r = post(server, "/generate", {"text": "hello", "sampling_params": {"max_new_tokens": 2}})
    assert r.status_code == 200, r.text
    assert engine_pid(server) == pid


# ---- 1. one ~80-byte request used to kill the engine ------------------------------------------
KILLERS = [
    # (sampling_params, expected status, param named)
    ({"stop": 5}, 400, "sampling_params.stop"),
    ({"stop": [1]}, 400, "sampling_params.stop"),
    ({"stop_token_ids": 5}, 400, "sampling_params.stop_token_ids"),
    ({"stop_token_ids": "x"}, 400, "sampling_params.stop_token_ids"),
    ({"stop_token_ids": [10**7]}, 400, "sampling_params.stop_token_ids[0]"),
    ({"stop_token_ids": [-1]}, 400, "sampling_params.stop_token_ids[0]"),
    ({"top_k": 1.5}, 400, "sampling_params.top_k"),
    ({"seed": 1.5}, 400, "sampling_params.seed"),
    ({"skip_special_tokens": "x"}, 400, "sampling_params.skip_special_tokens"),
    ({"min_new_tokens": -1}, 400, "sampling_params.min_new_tokens"),
    ({"logprobs": True}, 200, None),  # not an SGLang sampling field: ignored
    ({"force_token_ids": [999999]}, 200, None),  # internal: not settable, ignored
    ({"force_token_ids": [-3]}, 200, None),
    ({"force_token_ids": 5}, 200, None),
    ({"force_after_token_id": "x"}, 200, None),
    ({"grammar_after_token_id": 10**7}, 200, None),  # internal: not settable, ignored
    ({"tool_call_grammar": "{"}, 200, None),
    ({"regex": 5}, 400, "sampling_params.regex"),
    ({"regex": ""}, 400, "sampling_params.regex"),
    ({"regex": "("}, 400, "sampling_params.regex"),  # does not compile: named before the engine
    ({"json_schema": "{"}, 400, "sampling_params.json_schema"),
    ({"ebnf": ["root ::= x"]}, 400, "sampling_params.ebnf"),
]


@pytest.mark.parametrize("params,status,param", KILLERS)
def test_sampling_params_cannot_kill_the_engine(
    main_server: Server, params: dict, status: int, param: str | None
):
    pid = engine_pid(main_server)
    body = {"text": "hi", "sampling_params": {"max_new_tokens": 2, **params}}
    r = post(main_server, "/generate", body)
    if status == 200:
        assert r.status_code == 200, r.text
    else:
        assert_openai_error(r, status, param)
    assert_serving(main_server, pid)


def test_internal_fields_are_ignored(main_server: Server):
    """Internal fields from outside (`force_token_ids`, `tool_call_grammar`, ...) do not steer
    generation (greedy output unchanged)."""
    base = {"text": "hi", "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
    plain = post(main_server, "/generate", base).json()["output_ids"]
    grammar = '{"format": "glm47", "tools": [], "mode": "required", "parallel": true}'
    for internal in ({"force_token_ids": [7, 7, 7, 7]}, {"tool_call_grammar": grammar},
                     {"grammar_after_token_id": 0}):  # fmt: skip
        params = {**base["sampling_params"], **internal}
        forced = post(main_server, "/generate", {**base, "sampling_params": params}).json()
        assert forced["output_ids"] == plain, internal


# ---- 2. unbounded work ------------------------------------------------------------------------
def test_n_and_sequences_are_bounded(main_server: Server):
    r = post(  # each post's timeout is the hang guard: a refused n starts no work
        main_server, "/generate", {"text": "hi", "sampling_params": {"n": 4611686018427387904}}
    )
    assert_openai_error(r, 400, "sampling_params.n")
    r = post(main_server, "/generate", {"text": "hi", "sampling_params": {"n": 5000}})
    assert_openai_error(r, 400, "sampling_params.n")
    assert_openai_error(post(main_server, "/v1/chat/completions", {"messages": USER, "n": 65}),
                        400, "n")  # fmt: skip
    many = {"prompt": ["a"] * 200, "n": 64, "max_tokens": 1}
    assert_openai_error(post(main_server, "/v1/completions", many), 400, "prompt")
    assert httpx.get(main_server.url + "/health", timeout=5).status_code == 200


# ---- 3. 500s for bad input --------------------------------------------------------------------
def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


ROUTES = ["/v1/chat/completions", "/v1/completions", "/generate", "/v1/messages",
          "/v1/messages/count_tokens", "/v1/responses", "/abort_request"]  # fmt: skip


@pytest.mark.parametrize("path", ROUTES)
@pytest.mark.parametrize("depth", [100, 5000, 90_000])  # 90k: under the 200 kB cap
def test_deep_json_is_a_400(main_server: Server, path: str, depth: int):
    body = ('{"messages": ' + nested(depth) + ', "text": "x", "prompt": "x"}').encode()
    r = httpx.post(main_server.url + path, content=body, headers=JSON, timeout=60)
    assert r.status_code == 400, r.text
    assert "nested deeper" in r.text


SURROGATE = "a\ud800b"
SURROGATES = [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": SURROGATE}]},
     "messages[0].content"),
    ("/v1/chat/completions", {"messages": USER, "stop": [SURROGATE]}, "stop[0]"),
    ("/v1/completions", {"prompt": SURROGATE}, "prompt"),
    ("/generate", {"text": SURROGATE}, "text"),
    ("/generate", {"text": "x", "sampling_params": {"stop": SURROGATE}}, "sampling_params.stop"),
    ("/v1/messages", {"max_tokens": 2, "messages": [{"role": "user", "content": SURROGATE}]},
     None),
    ("/v1/messages/count_tokens", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": SURROGATE}]}]}, None),
    ("/v1/responses", {"input": SURROGATE}, "input"),
    ("/v1/responses", {"input": [{"role": "user", "content": [
        {"type": "input_text", "text": SURROGATE}]}]}, "input[0].content[0].text"),
]  # fmt: skip


@pytest.mark.parametrize("path,body,param", SURROGATES)
def test_lone_surrogates_are_a_400_naming_the_field(
    main_server: Server, path: str, body: dict, param: str | None
):
    data = json.dumps(body).encode()  # ensure_ascii: the surrogate travels as \ud800
    assert b"\\ud800" in data
    r = httpx.post(main_server.url + path, content=data, headers=JSON, timeout=60)
    if path.startswith("/v1/messages"):
        assert "surrogate" in assert_anthropic_error(r)["message"]
    else:
        assert "surrogate" in assert_openai_error(r, 400, param)["message"]


BIG = 2**64
BIG_INTS = [
    ("/v1/chat/completions", {"messages": USER, "seed": BIG}, "seed"),
    ("/v1/chat/completions", {"messages": USER, "seed": 2**63}, "seed"),
    ("/v1/chat/completions", {"messages": USER, "top_k": BIG}, "top_k"),
    ("/v1/chat/completions", {"messages": USER, "stop_token_ids": [BIG]}, "stop_token_ids"),
    ("/v1/completions", {"prompt": [1, BIG]}, "prompt"),
    ("/v1/completions", {"prompt": [[1, 2], [BIG]]}, "prompt"),
    ("/generate", {"input_ids": [BIG]}, "input_ids"),
    ("/generate", {"input_ids": [2**63]}, "input_ids[0]"),
    ("/generate", {"text": "x", "sampling_params": {"seed": BIG}}, "sampling_params.seed"),
    ("/generate", {"text": "x", "sampling_params": {"max_new_tokens": "abc"}},
     "sampling_params.max_new_tokens"),
    ("/generate", {"text": "x", "sampling_params": {"max_new_tokens": 2.5}},
     "sampling_params.max_new_tokens"),
    ("/generate", {"text": "x", "sampling_params": {"seed": "x"}}, "sampling_params.seed"),
    ("/generate", {"text": "x", "sampling_params": {"n": 1.5}}, "sampling_params.n"),
    ("/generate", {"text": "x", "top_logprobs_num": BIG}, None),
    ("/v1/responses", {"input": "x", "max_output_tokens": BIG}, "max_output_tokens"),
    ("/v1/responses", {"input": "x", "temperature": "hot"}, "temperature"),
]  # fmt: skip


@pytest.mark.parametrize("path,body,param", BIG_INTS)
def test_out_of_range_numbers_are_a_400(main_server: Server, path: str, body: dict, param):
    assert_openai_error(post(main_server, path, body), 400, param)


def test_infinity_and_nan_are_refused(main_server: Server):
    for value in (b"Infinity", b"-Infinity", b"NaN"):
        body = b'{"text": "x", "sampling_params": {"temperature": ' + value + b"}}"
        r = httpx.post(main_server.url + "/generate", content=body, headers=JSON)
        assert_openai_error(r, 400, "sampling_params.temperature")
    body = b'{"messages": [{"role": "user", "content": "x"}], "top_p": NaN}'
    r = httpx.post(main_server.url + "/v1/chat/completions", content=body, headers=JSON)
    assert_openai_error(r, 400, "top_p")


# ---- 4. accepted silently, should be 400 ------------------------------------------------------
ANTHROPIC_BAD = [
    {"max_tokens": 2, "messages": [{"role": "user", "content": [{"type": "bogus", "text": "x"}]}]},
    {"max_tokens": 2, "messages": USER, "system": [{"type": "bogus", "text": "x"}]},
    {"max_tokens": 2, "messages": USER, "system": [{"type": "image", "source": {}}]},
    {"max_tokens": 2, "messages": USER, "thinking": {"type": ["x"]}},
    {"max_tokens": 2, "messages": USER, "thinking": {"type": "sometimes"}},
    {"max_tokens": 2, "messages": USER, "tool_choice": {"type": 5}},
    {"max_tokens": 2, "messages": [{"role": "user", "content": [
        {"type": "tool_result", "content": "x"}]}]},
]  # fmt: skip


@pytest.mark.parametrize("body", ANTHROPIC_BAD)
@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages/count_tokens"])
def test_anthropic_rejects_what_it_used_to_accept(main_server: Server, path: str, body: dict):
    assert_anthropic_error(post(main_server, path, body))


def test_openai_rejects_what_it_used_to_accept(main_server: Server):
    tool = {"messages": [*USER, {"role": "tool", "content": "42"}]}
    assert_openai_error(post(main_server, "/v1/chat/completions", tool), 400, "messages[1]")
    part = {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}
    assert_openai_error(post(main_server, "/v1/chat/completions", part), 400, "messages[0]")
    stops = {"messages": USER, "stop": ["x"] * 65}
    assert_openai_error(post(main_server, "/v1/chat/completions", stops), 400, "stop")
    long_stop = {"messages": USER, "stop": "x" * 2000}
    assert_openai_error(post(main_server, "/v1/chat/completions", long_stop), 400, "stop")


def test_unknown_top_level_fields_are_accepted(main_server: Server):
    """Routers re-serialise bodies with fields of their own (bootstrap_room up to 2^63, ...)."""
    extra = {"bootstrap_host": "h", "bootstrap_port": 8998, "bootstrap_room": 2**63 - 1,
             "return_hidden_states": False, "some_future_field": {"a": [1, 2]}}  # fmt: skip
    r = post(main_server, "/v1/chat/completions", {"messages": USER, "max_tokens": 1, **extra})
    assert r.status_code == 200, r.text
    r = post(main_server, "/generate", {"text": "x", "sampling_params": {"max_new_tokens": 1},
                                        **extra})  # fmt: skip
    assert r.status_code == 200, r.text


# ---- 5. ghost rids ----------------------------------------------------------------------------
def test_a_refused_rid_is_free_again(main_server: Server):
    url = main_server.url
    r = post(main_server, "/generate", {"text": "x" * 10, "rid": "ghost", "input_ids": None,
                                        "sampling_params": {"max_new_tokens": 10**9}})  # fmt: skip
    assert_openai_error(r, 400, "sampling_params.max_new_tokens")
    r = post(main_server, "/generate", {"input_ids": [1] * CONTEXT_LENGTH, "rid": "ghost"})
    assert_openai_error(r, 400, "input_ids")
    r = post(main_server, "/generate", {"text": "x", "rid": "ghost",
                                        "sampling_params": {"max_new_tokens": 1}})  # fmt: skip
    assert r.status_code == 200, r.text
    aborted = httpx.post(url + "/abort_request", json={"abort_all": True}).json()["aborted"]
    assert not [rid for rid in aborted if rid.startswith("ghost")]


# ---- 6. edges ---------------------------------------------------------------------------------
def test_context_errors_name_the_prompt_field(main_server: Server):
    long = "hello " * CONTEXT_LENGTH
    error = assert_openai_error(post(main_server, "/v1/completions", {"prompt": long}), 400)
    assert error["param"] == "prompt" and error["code"] == "context_length_exceeded"
    error = assert_openai_error(post(main_server, "/generate", {"text": long}), 400)
    assert error["param"] == "text" and error["code"] == "context_length_exceeded"
    error = assert_openai_error(post(main_server, "/generate", {"input_ids": [5] * 2000}), 400)
    assert error["param"] == "input_ids"


def test_count_tokens_counts_any_length(main_server: Server):
    long = "hello " * (2 * CONTEXT_LENGTH)
    r = post(main_server, "/v1/messages/count_tokens", {"messages": [
        {"role": "user", "content": long}]})  # fmt: skip
    assert r.status_code == 200, r.text
    assert r.json()["input_tokens"] > 2 * CONTEXT_LENGTH


def test_not_found_and_wrong_method_use_the_error_shape(main_server: Server):
    assert_openai_error(httpx.get(main_server.url + "/nope"), 404)
    assert_openai_error(httpx.get(main_server.url + "/v1/chat/completions"), 405)
    r = httpx.get(main_server.url + "/v1/messages")
    assert r.status_code == 405 and r.json()["type"] == "error"


@pytest.mark.parametrize("kind", ["text/plain", "application/x-www-form-urlencoded",
                                  "multipart/form-data; boundary=x"])  # fmt: skip
def test_non_json_posts_are_415(main_server: Server, kind: str):
    body = b'{"abort_all": true}'
    for path in ("/abort_request", "/flush_cache", "/generate"):
        r = httpx.post(main_server.url + path, content=body, headers={"content-type": kind})
        assert_openai_error(r, 415)
    r = httpx.post(main_server.url + "/v1/messages", content=body, headers={"content-type": kind})
    assert r.status_code == 415 and r.json()["type"] == "error"
    r = httpx.post(main_server.url + "/abort_request", content=body)  # no content type at all
    assert_openai_error(r, 415)
    r = httpx.post(main_server.url + "/generate", content=b'{"text": "x"}',
                   headers={"content-type": "application/json; charset=utf-8"})  # fmt: skip
    assert r.status_code == 200, r.text


def test_openapi_describes_every_request_body(main_server: Server):
    schema = httpx.get(main_server.url + "/openapi.json").json()
    paths = schema["paths"]
    for path in ROUTES:
        body = paths[path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        name = body["$ref"].rsplit("/", 1)[1]
        assert name in schema["components"]["schemas"], name
    chat = schema["components"]["schemas"]["ChatCompletionRequest"]
    assert "messages" in chat["required"] and "n" in chat["properties"]
    generate = schema["components"]["schemas"]["NativeSamplingParams"]["properties"]
    assert "max_new_tokens" in generate and "force_token_ids" not in generate
    assert "regex" in generate and "tool_call_grammar" not in generate


def test_idle_after_everything(main_server: Server):
    """After all the inputs above: no running, waiting or ghost requests, KV back to idle."""

    def idle() -> dict | None:
        stats = httpx.get(main_server.url + "/get_server_info").json()["internal_states"][0]
        return stats if stats["num_running"] == 0 and stats["num_waiting"] == 0 else None

    last = lambda: httpx.get(main_server.url + "/get_server_info").json()  # noqa: E731
    stats = wait_for(idle, lambda: f"no request running or waiting; last: {last()}")
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0, stats
    assert stats["kv_used_tokens"] == 0, stats
    assert httpx.post(main_server.url + "/abort_request", json={"abort_all": True}).json() == {
        "aborted": []
    }
