"""Issue 12, the parts that need their own server: `/health` answers while a 30 MB body is
decoded and rejected, and the stats routes answer while the engine is inside a step (stats come
from the last published ones), half-sent headers and a body shorter than its Content-Length are
timed out (issue 32), and the API key can come from the environment (so it stays out of `ps`),
with `/openapi.json` behind it. The decode worker or the engine is stopped (SIGSTOP) meanwhile, so
"while" is an order of events, not a latency."""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlparse

import httpx
import pytest
from server_harness import HANG_GUARD_S, Server, children, running_server, wait_for, write_scripts

KEY = "sk-from-the-environment"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def edge_server(server_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    slow = {"slow": {"text": "a " * 5000, "chunk": 1, "delay": 0.2}}  # 1000 steps: minutes
    scripts = write_scripts(tmp_path_factory.mktemp("edge_scripts"), slow)
    flags = ["--header-timeout", "1", "--enable-metrics"]
    with running_server(server_checkpoint, *flags, env={"DSASERVE_API_KEY": KEY},
                        scripts=scripts) as server:  # fmt: skip
        yield server


def engine_pid(server: Server) -> int:
    return httpx.get(server.url + "/get_server_info", headers=AUTH).json()["engine_pid"]


def decode_worker(server: Server) -> int:
    """The API process's body-decoder process (body_decoder.py): its spawned child that is not
    the engine (the decoder starts with the server)."""
    engine = engine_pid(server)
    spawned = [
        pid
        for pid in children(server.process.pid)
        if pid != engine and b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()
    ]
    assert len(spawned) == 1, spawned
    return spawned[0]


class Stopped:
    """SIGSTOP a process for the block, SIGCONT it after (even on failure)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid

    def __enter__(self) -> None:
        os.kill(self.pid, signal.SIGSTOP)

    def __exit__(self, *exc: object) -> None:
        os.kill(self.pid, signal.SIGCONT)


def test_health_answers_while_a_30mb_body_is_decoded(edge_server: Server):
    """The 30 MB body is decoded in the worker process, off the API loop: with the worker
    stopped, the body cannot be answered, yet `/health` answers; once it runs, the body gets its
    400 naming the field."""
    message = {"role": "user", "content": "y" * 10}
    body = json.dumps({"messages": [message] * 700_000}).encode()
    assert 25e6 < len(body) < 32 * 1024 * 1024
    answer: list[httpx.Response] = []
    sent = threading.Event()

    def pieces() -> Iterator[bytes]:
        for start in range(0, len(body), 1 << 20):
            yield body[start : start + (1 << 20)]
        sent.set()  # httpx asks for more only once the last piece is written

    def send() -> None:
        answer.append(httpx.post(edge_server.url + "/v1/chat/completions", content=pieces(),
                                 headers=AUTH | {"content-type": "application/json",
                                                 "content-length": str(len(body))},
                                 timeout=HANG_GUARD_S))  # fmt: skip

    work = threading.Thread(target=send)
    with Stopped(decode_worker(edge_server)):
        work.start()
        assert sent.wait(HANG_GUARD_S)  # hang guard
        for _ in range(5):
            assert httpx.get(edge_server.url + "/health", timeout=HANG_GUARD_S).status_code == 200
        assert not answer  # the body waits for the stopped worker; /health did not
    work.join(HANG_GUARD_S)  # hang guard
    assert answer[0].status_code == 400, answer[0].text
    assert answer[0].json()["error"]["param"] == "messages"


def test_stats_do_not_wait_for_a_step(edge_server: Server):
    """With the engine stopped inside its run, `/get_server_info` and `/metrics` answer from the
    stats it last published (the running request among them), and `/health` answers (200, or
    503 once the stopped rank's heartbeat is late): none waits for the engine."""
    url, rid = edge_server.url, "edge-slow"
    body = {"text": "[[script:slow]]", "rid": rid, "sampling_params": {"max_new_tokens": 1000}}
    answer: list[httpx.Response] = []
    work = threading.Thread(target=lambda: answer.append(
        httpx.post(url + "/generate", json=body, headers=AUTH, timeout=HANG_GUARD_S)))  # fmt: skip
    work.start()
    scripted = lambda: httpx.get(url + "/get_server_info", headers=AUTH).json()[  # noqa: E731
        "internal_states"][0]["num_scripted"]  # fmt: skip
    wait_for(lambda: answer or scripted() == 1, "the slow request admitted")
    assert not answer, answer[0].text
    with httpx.Client(base_url=url, headers=AUTH, timeout=HANG_GUARD_S) as client:
        with Stopped(engine_pid(edge_server)):
            info = client.get("/get_server_info")
            metrics = client.get("/metrics")
            health = client.get("/health")
            assert not answer  # the request is still running: the engine is stopped
    assert info.status_code == 200 and info.json()["internal_states"][0]["num_scripted"] == 1
    assert metrics.status_code == 200 and "sglang:num_running_reqs" in metrics.text
    assert health.status_code in (200, 503), health.text
    aborted = httpx.post(url + "/abort_request", json={"rid": rid}, headers=AUTH).json()
    assert aborted == {"aborted": [f"{rid}-0"]}  # the request of choice 0
    work.join(HANG_GUARD_S)  # hang guard
    assert answer[0].status_code == 200
    assert answer[0].json()["meta_info"]["finish_reason"]["type"] == "abort"


def test_half_sent_headers_are_timed_out(edge_server: Server):
    address = urlparse(edge_server.url)
    with socket.create_connection((address.hostname, address.port), timeout=15) as conn:
        conn.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # never finished
        conn.settimeout(HANG_GUARD_S)  # hang guard: --header-timeout 1 closes it
        try:
            data = conn.recv(1024)
        except TimeoutError:
            data = b"still open"
        assert data == b"", data  # closed by the server, with nothing answered
    with socket.create_connection((address.hostname, address.port), timeout=15) as conn:
        conn.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")  # a whole request is answered
        assert conn.recv(1024).startswith(b"HTTP/1.1 200")


def test_a_body_shorter_than_its_content_length_is_cut_off(edge_server: Server):
    address = urlparse(edge_server.url)
    with socket.create_connection((address.hostname, address.port), timeout=15) as conn:
        conn.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: 5000\r\n"
                     b"\r\n{\"text\": \"x\"")  # fmt: skip
        conn.settimeout(HANG_GUARD_S)  # hang guard: --header-timeout 1 here, between pieces
        try:
            while conn.recv(1024):  # whatever it answers, the connection must end
                pass
            closed = True
        except TimeoutError:
            closed = False
        assert closed
    assert httpx.get(edge_server.url + "/health", timeout=10).status_code == 200


def test_api_key_from_the_environment(edge_server: Server):
    url = edge_server.url
    cmdline = Path(f"/proc/{edge_server.process.pid}/cmdline").read_bytes()
    assert KEY.encode() not in cmdline
    body = {"text": "x", "sampling_params": {"max_new_tokens": 1}}
    assert httpx.post(url + "/generate", json=body).status_code == 401
    assert httpx.post(url + "/generate", json=body, headers=AUTH).status_code == 200
    assert httpx.get(url + "/openapi.json").status_code == 401
    schema = httpx.get(url + "/openapi.json", headers=AUTH).json()
    assert "requestBody" in schema["paths"]["/generate"]["post"]
    assert httpx.get(url + "/get_server_info", headers=AUTH).json()["api_key"] == "***"
