"""Bad input gets 400 in OpenAI's error shape naming the field (413 for big bodies), never a 500;
disconnects at any stage free the request's KV (field reports §4 and I39)."""

from __future__ import annotations

import contextlib
import json
import socket
from collections.abc import Iterator

import httpx
import pytest
from conftest import MAX_REQUEST_BYTES
from server_harness import CONTEXT_LENGTH, Server, wait_for

USER = [{"role": "user", "content": "hi"}]
CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "[1, 2]"}}
BAD_CALL = [*USER, {"role": "assistant", "content": "", "tool_calls": [CALL]}]
CASES = [
    # (body, expected param (prefix), expected code)
    ({"messages": "hello"}, "messages", None),
    ({"messages": []}, "messages", None),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role", None),
    ({"messages": USER, "max_tokens": -1}, "max_tokens", None),
    ({"messages": USER, "max_tokens": 10**9}, "max_tokens", None),
    ({"messages": USER, "temperature": "hot"}, "temperature", None),
    ({"messages": USER, "n": 0}, "n", None),
    ({"messages": USER, "top_p": 3}, "top_p", None),
    ({"messages": BAD_CALL}, "messages[1].tool_calls[0].arguments", None),
    ({"messages": USER, "tools": [{"type": "function", "function": {}}]}, "tools[0]", None),
    ({"messages": USER, "tool_choice": "sometimes"}, "tool_choice", None),
    ({"messages": [{"role": "user", "content": "hello " * CONTEXT_LENGTH}]}, "messages",
     "context_length_exceeded"),
]  # fmt: skip


@pytest.mark.parametrize("body,param,code", CASES)
def test_bad_chat_input(main_server: Server, body: dict, param: str, code: str | None):
    r = httpx.post(main_server.url + "/v1/chat/completions", json={"model": "m", **body},
                   timeout=60)  # fmt: skip
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"].startswith(param), error
    assert error["type"] == "BadRequestError" and error["message"]
    if code:
        assert error["code"] == code
    assert len(r.content) < 2000  # small bodies, inputs not echoed


def test_malformed_and_oversized_bodies(main_server: Server):
    url = main_server.url + "/v1/chat/completions"
    r = httpx.post(url, content=b'{"messages": [', headers={"content-type": "application/json"})
    assert r.status_code == 400 and "malformed JSON" in r.json()["error"]["message"]
    json_type = {"content-type": "application/json"}
    r = httpx.post(url, content=b"[1, 2]", headers=json_type)
    assert r.status_code == 400
    big = b'{"messages": "' + b"x" * MAX_REQUEST_BYTES + b'"}'
    assert httpx.post(url, content=big, headers=json_type).status_code == 413

    def chunks():  # no content-length: the limit still holds
        for _ in range(4):
            yield b"x" * (MAX_REQUEST_BYTES // 2)

    assert httpx.post(url, content=chunks(), headers=json_type).status_code == 413
    many = {"messages": [{"role": "bad", "content": "y" * 50}] * 1000}
    r = httpx.post(url, json=many)
    assert r.status_code == 400 and len(r.content) < 2000


def test_other_routes_reject_bad_input(main_server: Server):
    url = main_server.url
    assert httpx.post(url + "/v1/completions", json={"prompt": ""}).status_code == 400
    assert (
        httpx.post(url + "/v1/completions", json={"prompt": "x", "suffix": "y"}).status_code == 400
    )
    r = httpx.post(url + "/generate", json={"sampling_params": {"max_new_tokens": 2}})
    assert r.status_code == 400
    r = httpx.post(url + "/generate", json={"input_ids": [10**7]})  # engine refuses: 400 too
    assert r.status_code == 400, r.text
    r = httpx.post(url + "/generate", json={"text": "x", "sampling_params": {"top_k": 0}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "sampling_params.top_k"
    bad = httpx.post(
        url + "/abort_request", content=b"{bad", headers={"content-type": "application/json"}
    )
    assert bad.status_code == 400
    assert httpx.post(url + "/abort_request", json={}).status_code == 400


def _stats(url: str) -> dict:
    return httpx.get(url + "/get_server_info").json()["internal_states"][0]


def _idle(url: str, baseline: int | None = None) -> dict:
    """The engine's stats once nothing runs or waits and (given a baseline) its KV is back to
    it."""

    def settled() -> dict | None:
        stats = _stats(url)
        idle = stats["num_running"] == 0 and stats["num_waiting"] == 0
        freed = baseline is None or stats["kv_used_tokens"] <= baseline
        return stats if idle and freed else None

    return wait_for(settled, lambda: f"the engine idle, its KV back; last: {_stats(url)}")


def _give_up_once_running(url: str, body: dict) -> None:
    """A non-streaming client that sends `body` and goes away once the engine runs it (seen in
    its stats, so mid-prefill or mid-decode), before any answer came back."""
    host, port = url.removeprefix("http://").split(":")
    data = json.dumps(body).encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n")  # fmt: skip
    with socket.create_connection((host, int(port))) as client:
        client.sendall(head.encode() + data)
        client.setblocking(False)
        answer, last = bytearray(), {}

        def running_or_answered() -> bool:
            """Running, or answered or closed first (then the assertion below says which)."""
            with contextlib.suppress(BlockingIOError):
                chunk = client.recv(4000)
                answer.extend(chunk or b"(closed)")
            last.update(_stats(url))
            return bool(answer) or last["num_running"] > 0

        wait_for(running_or_answered, lambda: f"the request running; last stats: {last}",
                 poll=0.01)  # fmt: skip
        assert not answer, f"answered before the client went away: {bytes(answer)}"


@contextlib.contextmanager
def paced(url: str) -> Iterator[None]:
    """A scripted long answer streaming alongside: while it runs, every engine step sleeps 5 ms
    (tests/scripted_engine.py), so a 900-token request runs for at least 4.5 s on any machine and
    is still running when the test looks at it (one pacer lives at least 37 s). It is not counted
    in the engine's stats."""
    body = {"model": "m", "messages": [{"role": "user", "content": "go [[script:long]]"}],
            "stream": True}  # fmt: skip
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=120) as pacer:
        next(pacer.iter_lines())  # it runs; it is aborted when this block leaves
        yield


def test_disconnects_free_kv(main_server: Server):
    """Each disconnect stops its request at once: the KV is back and fewer than its 900 tokens
    were generated (with ignore_eos, one run to the end makes exactly 900)."""
    url = main_server.url
    stats = _idle(url)
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0, stats
    baseline = stats["kv_used_tokens"]
    body = {"model": "m", "messages": [{"role": "user", "content": "tell me a long story"}],
            "max_tokens": 900, "ignore_eos": True}  # fmt: skip

    def stopped_early(before: dict) -> dict:
        after = _idle(url, baseline)
        assert after["num_running"] == 0 and after["num_waiting"] == 0
        assert after["kv_used_tokens"] <= baseline
        generated = after["generated_tokens"] - before["generated_tokens"]
        assert generated < 900, f"{generated} tokens generated for a disconnected client"
        return after

    for i in range(6):  # mid-stream disconnects
        with paced(url), httpx.stream("POST", url + "/v1/chat/completions", timeout=60,
                                      json=body | {"stream": True}) as r:  # fmt: skip
            for n, _ in enumerate(r.iter_lines()):
                if i == 0 and n == 2:  # while it runs, it holds KV
                    busy = _stats(url)
                    assert busy["num_running"] == 1 and busy["kv_used_tokens"] > baseline, busy
                if n >= 2 + i:
                    break
            assert n == 2 + i  # it went away mid-stream, not after the end
        stats = stopped_early(stats)
    for _ in range(4):  # non-streaming clients that give up (mid-prefill or mid-decode)
        with paced(url):
            _give_up_once_running(url, body)
        stats = stopped_early(stats)


def test_duplicate_rid_is_refused_without_harming_the_first(main_server: Server):
    url = main_server.url + "/v1/chat/completions"
    # the scripted long answer sleeps 5 ms a step: 1000 steps keep the first in flight for at
    # least 5 s on any machine, so the second arrives while it runs
    body = {"model": "m", "messages": [{"role": "user", "content": "go [[script:long]]"}],
            "max_tokens": 1000, "rid": "dup"}  # fmt: skip
    with httpx.stream("POST", url, json=body | {"stream": True}, timeout=120) as first:
        lines = filter(None, first.iter_lines())
        next(lines)
        second = httpx.post(url, json=body, timeout=60)
        assert second.status_code == 400 and second.json()["error"]["param"] == "rid"
        rest = list(lines)
    assert rest[-1] == "data: [DONE]"
    last = json.loads(rest[-2].removeprefix("data: "))
    assert last["choices"][0]["finish_reason"] == "length", last  # it ran to its max_tokens
