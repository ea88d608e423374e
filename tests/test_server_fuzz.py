"""Property-based fuzzing of every route against a running server (issue 12).

Bodies come from the route models themselves: every known field of a route (nested sampling
params and messages included) gets either a plausible value or a hostile one (wrong types, 2^70,
lone surrogates, NaN-free extremes, deep nesting, huge strings), plus unknown fields. Whatever
the body: no 5xx, every error in the API's own shape and under a few kB, `/health` 200 after each
request, the same engine process at the end of each route's run (an engine death fails the
test that caused it), and the engine back to idle.

Each run draws a fresh seed (printed on failure: tests/fuzz_seed.py), EXAMPLES bodies per route
(NIGHTLY with --nightly), with output lengths as clients ask for them: mostly short, one in four
up to LONG tokens.
"""

from __future__ import annotations

import json

import httpx
import pytest
from fuzz_seed import run_seeded
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_harness import Server, wait_for

from dsaserve.server.anthropic.protocol import Message, MessagesRequest
from dsaserve.server.openai.protocol import (
    AbortIn,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    GenerateRequestIn,
    NativeSamplingParams,
)
from dsaserve.server.openai.responses_protocol import InputItem, ResponsesRequest

EXAMPLES = 200
NIGHTLY = 2000
LONG = 128  # the longest output a valid request asks for
MAX_ERROR_BYTES = 4000
LENGTH_FIELDS = ("max_tokens", "max_new_tokens", "max_completion_tokens", "max_output_tokens")
lengths = st.one_of(st.integers(0, 16), st.integers(0, 16), st.integers(0, 16),
                    st.integers(17, LONG))  # fmt: skip

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.integers(-3, 70),
    st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=12),
    st.sampled_from(["a\ud800b", "\udfff", "", "x" * 3000, "[[script:answer]]", "-1", "1.5"]),
)  # fmt: skip
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),  # noqa: E501
    max_leaves=12,
)  # fmt: skip
token_lists = st.lists(st.integers(-5, 200_000), min_size=0, max_size=6)  # some out of vocab


def deep(depth: int) -> object:
    value: object = 0
    for _ in range(depth):
        value = [value]
    return value


hostile = st.one_of(json_values, token_lists, st.integers(60, 80).map(deep))


def mutated(model: type, base: st.SearchStrategy[dict]) -> st.SearchStrategy[dict]:
    """A plausible body with up to two of the model's known fields made hostile."""
    names = st.sampled_from(sorted(model.model_fields))
    mutations = st.dictionaries(names, hostile, max_size=2)
    return st.builds(lambda body, changes: {**body, **changes}, base, mutations)


text = st.text(max_size=20)
ids = st.lists(st.integers(0, 1000), min_size=1, max_size=6)
roles = st.sampled_from(["system", "user", "assistant"])
chat_message = mutated(ChatMessage, st.fixed_dictionaries({"role": roles, "content": text}))
anthropic_message = mutated(Message, st.fixed_dictionaries({"role": roles, "content": text}))
responses_item = mutated(InputItem, st.fixed_dictionaries({"role": roles, "content": text}))
common = {"stream": st.booleans(), "temperature": st.floats(0, 2), "n": st.integers(1, 2),
          "stop": st.lists(st.text(min_size=1, max_size=4), max_size=2)}  # fmt: skip
sampling = mutated(
    NativeSamplingParams,
    st.fixed_dictionaries(
        {"max_new_tokens": lengths},
        optional={
            "temperature": st.floats(0, 2),
            "top_k": st.integers(1, 5),
            "n": st.integers(1, 2),
            "stop": text,
            "stop_token_ids": ids,
            "seed": st.integers(0, 2**63 - 1),
        },
    ),
)
ROUTES = {
    "/v1/chat/completions": mutated(ChatCompletionRequest, st.fixed_dictionaries(
        {"messages": st.lists(chat_message, min_size=1, max_size=3),
         "max_tokens": lengths}, optional=common)),
    "/v1/completions": mutated(CompletionRequest, st.fixed_dictionaries(
        {"prompt": st.one_of(text.filter(bool), ids, st.lists(ids, min_size=1, max_size=2)),
         "max_tokens": lengths}, optional=common)),
    "/generate": mutated(GenerateRequestIn, st.builds(
        lambda prompt, rest: {**prompt, **rest},
        st.one_of(st.fixed_dictionaries({"text": text.filter(bool)}),
                  st.fixed_dictionaries({"input_ids": ids})),
        st.fixed_dictionaries({"sampling_params": sampling},
                              optional={"stream": st.booleans(), "rid": text}))),
    "/v1/messages": mutated(MessagesRequest, st.fixed_dictionaries(
        {"messages": st.lists(anthropic_message, min_size=1, max_size=3),
         "max_tokens": lengths.map(lambda n: max(n, 1))},
        optional={"stream": st.booleans(), "system": text})),
    "/v1/messages/count_tokens": mutated(MessagesRequest, st.fixed_dictionaries(
        {"messages": st.lists(anthropic_message, min_size=1, max_size=3)})),
    "/v1/responses": mutated(ResponsesRequest, st.fixed_dictionaries(
        {"input": st.one_of(text.filter(bool), st.lists(responses_item, min_size=1, max_size=3)),
         "max_output_tokens": st.integers(0, 3)},
        optional={"stream": st.booleans(), "instructions": text, "temperature": st.floats(0, 2),
                  "store": st.booleans()})),
    "/abort_request": mutated(AbortIn, st.fixed_dictionaries(
        {}, optional={"rid": text, "abort_all": st.booleans()})),
}  # fmt: skip
extras = st.dictionaries(st.sampled_from(["bootstrap_room", "zzz", "lora_path"]), json_values)


def bounded_work(path: str, body: dict) -> dict:
    """Keep valid requests within LONG new tokens and 2 choices (a hostile length stays hostile:
    only a plausible one over LONG, or a missing one, is brought to LONG)."""
    for name in LENGTH_FIELDS:
        value = body.get(name)
        if name in body and (value is None or (isinstance(value, int) and value > LONG)):
            body[name] = LONG if not isinstance(value, bool) else value
    if path == "/generate" and isinstance(body.get("sampling_params"), dict):
        bounded_work("", body["sampling_params"])
        body["sampling_params"].setdefault("max_new_tokens", LONG)
    if path in ("/v1/chat/completions", "/v1/completions"):
        body.setdefault("max_tokens", LONG)
    if path == "/v1/responses":
        body.setdefault("max_output_tokens", LONG)
    for key in ("n",):
        if (
            isinstance(body.get(key), int)
            and not isinstance(body[key], bool)
            and 2 < body[key] < 100
        ):
            body[key] = 2
    return body


def check_answer(path: str, r: httpx.Response) -> None:
    assert r.status_code < 500, (path, r.status_code, r.text[:500])
    if r.status_code == 200:
        assert "InternalServerError" not in r.text and "api_error" not in r.text, r.text[:500]
        assert "response.failed" not in r.text, r.text[:500]
        return
    assert len(r.content) < MAX_ERROR_BYTES, (path, len(r.content))
    body = r.json()
    if path.startswith("/v1/messages"):
        assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
    else:
        assert set(body["error"]) == {"message", "type", "param", "code"}, body


def engine_pid(client: httpx.Client) -> int:
    return client.get("/get_server_info").json()["engine_pid"]


@pytest.fixture(scope="module")
def client(main_server: Server):
    with httpx.Client(base_url=main_server.url, timeout=120) as client:
        yield client


@pytest.mark.parametrize("path", list(ROUTES))
def test_fuzz_route(client: httpx.Client, path: str, request: pytest.FixtureRequest):
    statuses: dict[int, int] = {}
    pid = engine_pid(client)
    examples = NIGHTLY if request.config.getoption("--nightly") else EXAMPLES

    @settings(max_examples=examples, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(body=ROUTES[path], extra=extras)
    def run(body: dict, extra: dict) -> None:
        body = bounded_work(path, {**extra, **body})
        data = json.dumps(body).encode()  # lone surrogates travel as \\ud800 escapes
        r = client.post(path, content=data, headers={"content-type": "application/json"})
        check_answer(path, r)
        statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
        assert client.get("/health").status_code == 200, "the engine died"

    run_seeded(run)
    print(path, dict(sorted(statuses.items())))
    assert engine_pid(client) == pid  # no engine death (nor a quiet restart)
    assert statuses.get(400), statuses  # hostile values were refused...
    assert statuses.get(200), statuses  # ...and plausible ones served


def test_idle_after_fuzzing(client: httpx.Client):
    def idle() -> dict | None:
        stats = client.get("/get_server_info").json()["internal_states"][0]
        return stats if stats["num_running"] == stats["num_waiting"] == 0 else None

    def last() -> str:
        info = client.get("/get_server_info").json()
        return f"nothing running or waiting after the fuzz; last: {info}"

    stats = wait_for(idle, last)
    assert stats["num_running"] == stats["num_waiting"] == 0, stats
    assert client.post("/abort_request", json={"abort_all": True}).json() == {"aborted": []}
    r = client.post("/generate", json={"text": "fresh", "sampling_params": {"max_new_tokens": 2}})
    assert r.status_code == 200
