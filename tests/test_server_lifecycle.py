"""Operational behaviour of real `dsaserve serve` processes: API keys, queue limit (429 with
Retry-After), /abort_request, SIGTERM drain with no child left, and engine death (errors, /health
503, never a hang)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import openai
import pytest
from server_harness import Server, group_alive, running_server, wait_for, write_scripts

KEY = "sk-secret"
AUTH = {"Authorization": f"Bearer {KEY}"}
LONG = {"model": "m", "messages": [{"role": "user", "content": "a long story"}],
        "max_tokens": 900, "ignore_eos": True}  # fmt: skip


@pytest.fixture(scope="module")
def guarded_server(server_checkpoint: Path) -> Iterator[Server]:
    flags = ["--api-key", KEY, "--max-running-requests", "1", "--max-queued-requests", "1",
             "--shutdown-timeout", "60"]  # fmt: skip
    with running_server(server_checkpoint, *flags) as server:
        yield server


def info(server: Server) -> dict:
    return httpx.get(server.url + "/get_server_info", headers=AUTH).json()


def test_api_key(guarded_server: Server):
    url = guarded_server.url
    assert httpx.get(url + "/health").status_code == 200  # health stays open
    r = httpx.post(url + "/v1/chat/completions", json=LONG | {"max_tokens": 1})
    assert r.status_code == 401 and r.json()["error"]["type"] == "AuthenticationError"
    r = httpx.get(url + "/v1/models", headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()
    client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
    assert client.models.list().data
    message = anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0).messages.create(
        model="m", max_tokens=1, messages=[{"role": "user", "content": "hi"}]
    )  # x-api-key
    assert message.usage.output_tokens == 1
    r = httpx.post(url + "/v1/messages", json={"model": "m", "max_tokens": 1, "messages": []})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"


def test_queue_limit_answers_429(guarded_server: Server):
    """One request runs (the only running slot), one waits (the only queue place): a third is
    answered 429, and aborting the waiting one answers it. The two are sent together, so neither
    waits behind the HTTP side streaming the other; each runs ~0.5 s here, so the third may
    still arrive after the first ended (it then runs): that try is lost to the race and set up
    again. A server that never answers 429 loses all 5 tries."""
    url = guarded_server.url
    for attempt in range(5):
        results: dict = {}

        def send(name: str, results=results, attempt=attempt) -> None:
            body = LONG | {"rid": f"{name}{attempt}"}
            results[name] = httpx.post(url + "/v1/chat/completions", json=body, headers=AUTH,
                                       timeout=120)  # fmt: skip

        threads = [threading.Thread(target=send, args=(name,)) for name in "ab"]
        for t in threads:
            t.start()
        full = lambda r=results: len(r) == 2 or load(guarded_server) == (1, 1)  # noqa: E731
        wait_for(full, "one request running and one waiting (or both answered)")
        third = LONG | {"max_tokens": 1}
        r = None
        if len(results) < 2:
            r = httpx.post(url + "/v1/chat/completions", json=third, headers=AUTH, timeout=30)
        httpx.post(url + "/abort_request", json={"abort_all": True}, headers=AUTH)
        for t in threads:
            t.join(60)
        if r is None or r.status_code != 429:
            continue  # the first ended before the third arrived
        assert r.headers["Retry-After"] == "1" and r.json()["error"]["type"] == "RateLimitError"
        ends = [results[n].json()["choices"][0]["finish_reason"] for n in "ab"]
        assert "abort" in ends and set(ends) <= {"abort", "length"}, ends
        return
    raise AssertionError("no 429 in 5 tries")


def load(server: Server) -> tuple[int, int]:
    state = info(server)["internal_states"][0]
    return state["num_running"], state["num_waiting"]


def test_sigterm_drains_then_exits(guarded_server: Server):
    url = guarded_server.url
    done: dict = {"lines": []}
    first = threading.Event()

    def stream() -> None:
        body = LONG | {"stream": True}  # still running at SIGTERM
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, headers=AUTH,
                          timeout=120) as r:  # fmt: skip
            for line in filter(None, r.iter_lines()):
                done["lines"].append(line)
                first.set()

    thread = threading.Thread(target=stream)
    thread.start()
    assert first.wait(60)
    os.kill(guarded_server.process.pid, signal.SIGTERM)
    wait_for(lambda: httpx.get(url + "/health").status_code == 503, "/health 503 while draining")
    r = httpx.post(url + "/v1/chat/completions", json=LONG, headers=AUTH)
    assert r.status_code == 503 and "Retry-After" in r.headers
    thread.join(120)
    assert done["lines"][-1] == "data: [DONE]"
    assert any('"finish_reason": "length"' in line for line in done["lines"])  # finished, not cut
    assert guarded_server.process.wait(60) == 0
    wait_for(lambda: not group_alive(guarded_server.process.pid), "no child left")


def test_engine_death_fails_fast(server_checkpoint: Path):
    with running_server(server_checkpoint) as server:
        url = server.url
        engine_pid = httpx.get(url + "/get_server_info").json()["engine_pid"]
        lines: list[str] = []
        with httpx.stream("POST", url + "/v1/chat/completions", json=LONG | {"stream": True},
                          timeout=30) as r:  # fmt: skip
            for line in filter(None, r.iter_lines()):
                lines.append(line)
                if len(lines) == 2:
                    os.kill(engine_pid, signal.SIGKILL)
        assert lines[-1] == "data: [DONE]" and "engine" in lines[-2]
        assert httpx.get(url + "/health").status_code == 503
        r = httpx.post(url + "/v1/chat/completions", json=LONG, timeout=10)
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
        r = httpx.post(url + "/v1/messages", json={"model": "m", "max_tokens": 5,
                       "messages": [{"role": "user", "content": "x"}]}, timeout=10)  # fmt: skip
        assert r.status_code == 503 and r.json()["error"]["type"] == "overloaded_error"
        os.kill(server.process.pid, signal.SIGTERM)
        assert server.process.wait(30) == 0


def test_engine_start_failure_exits_with_a_message(tmp_path: Path, server_checkpoint: Path):
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(server_checkpoint / name, tmp_path / name)  # no config.json, no weights
    command = [sys.executable, "-m", "dsaserve.cli", "serve", "--model-path", str(tmp_path),
               "--port", "0"]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=180)
    assert done.returncode == 1
    assert "engine failed to start" in done.stderr


def test_watchdog_ends_a_stuck_engine(server_checkpoint: Path, tmp_path: Path):
    """A step longer than --watchdog-timeout ends the engine; the request fails, never hangs."""
    # a step of 10 minutes: without the watchdog the request outlives the client's hang guard
    scripts = write_scripts(tmp_path, {"stall": {"text": "slow", "chunk": 1, "delay": 600}})
    flags = ["--watchdog-timeout", "1"]  # no model: the scripts alone
    with running_server(server_checkpoint, *flags, scripts=scripts, real_engine=False) as server:
        r = httpx.post(
            server.url + "/v1/chat/completions",
            timeout=120,  # hang guard
            json={"model": "m", "messages": [{"role": "user", "content": "[[script:stall]]"}]},
        )
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
        assert httpx.get(server.url + "/health").status_code == 503
