"""Issue 12, the parts that need their own server: `/health` stays fast while a 30 MB body is
rejected and while an engine step runs (stats come from the last published ones), half-sent
headers and a body shorter than its Content-Length are timed out (issue 32), and the API key can
come from the environment (so it stays out of `ps`), with `/openapi.json` behind it."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlparse

import httpx
import pytest
from server_harness import Server, running_server, write_scripts

KEY = "sk-from-the-environment"
AUTH = {"Authorization": f"Bearer {KEY}"}
SLOW_STEP_S = 1.5
# The issue asks for 100 ms; a loaded 2-core CI box gets a margin. Waiting for a step (1.5 s) or
# for a 30 MB decode on the loop (~0.4-1 s) would still fail it.
LATENCY_LIMIT_S = 0.5


@pytest.fixture(scope="module")
def edge_server(server_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    slow = {"slow": {"text": "a b c d e f", "chunk": 1, "delay": SLOW_STEP_S}}
    scripts = write_scripts(tmp_path_factory.mktemp("edge_scripts"), slow)
    flags = ["--header-timeout", "1", "--enable-metrics"]
    with running_server(server_checkpoint, *flags, env={"DSASERVE_API_KEY": KEY},
                        scripts=scripts) as server:  # fmt: skip
        yield server


def latencies_while(server: Server, work: threading.Thread, paths: list[str]) -> dict:
    """Poll `paths` until `work` ends; each one's latencies, slowest first."""
    seen: dict[str, list[float]] = {path: [] for path in paths}
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=30) as client:
        while work.is_alive():
            for path in paths:
                start = time.perf_counter()
                assert client.get(path).status_code == 200
                seen[path].append(time.perf_counter() - start)
            time.sleep(0.02)
    return {path: sorted(times, reverse=True) for path, times in seen.items()}


def test_health_is_fast_while_a_30mb_body_is_rejected(edge_server: Server):
    message = {"role": "user", "content": "y" * 10}
    body = json.dumps({"messages": [message] * 700_000}).encode()
    assert 25e6 < len(body) < 32 * 1024 * 1024
    answer: list[httpx.Response] = []

    def send() -> None:
        answer.append(httpx.post(edge_server.url + "/v1/chat/completions", content=body,
                                 headers=AUTH | {"content-type": "application/json"},
                                 timeout=120))  # fmt: skip

    work = threading.Thread(target=send)
    work.start()
    worst = latencies_while(edge_server, work, ["/health"])["/health"][0]
    work.join()
    assert answer[0].status_code == 400, answer[0].text
    assert answer[0].json()["error"]["param"] == "messages"
    print(f"/health worst latency during a 30 MB rejection: {worst * 1000:.1f} ms")
    assert worst < LATENCY_LIMIT_S, worst


def test_stats_do_not_wait_for_a_step(edge_server: Server):
    body = {"text": "[[script:slow]]", "sampling_params": {"max_new_tokens": 3}}

    def run() -> None:
        r = httpx.post(edge_server.url + "/generate", json=body, headers=AUTH, timeout=60)
        assert r.status_code == 200

    work = threading.Thread(target=run)
    work.start()
    deadline = time.monotonic() + 4 * SLOW_STEP_S
    scripted = 0
    while not scripted and time.monotonic() < deadline:  # admitted, inside a slow step
        info = httpx.get(edge_server.url + "/get_server_info", headers=AUTH).json()
        scripted = info["internal_states"][0]["num_scripted"]
    times = latencies_while(edge_server, work, ["/health", "/get_server_info", "/metrics"])
    work.join()
    print("worst two latencies during 1.5 s steps:",
          {k: [f"{v * 1000:.1f} ms" for v in t[:2]] for k, t in times.items()})  # fmt: skip
    # A route that waited for the step would be slow at least twice (the request runs three
    # 1.5 s steps, each poll waiting for the next step's end); one slow poll is the 2-core CI
    # machine descheduling the server (CI measured one 622 ms /health once, 4-12 ms here).
    second = {path: t[1] if len(t) > 1 else 0.0 for path, t in times.items()}
    assert max(second.values()) < LATENCY_LIMIT_S, times
    assert scripted == 1  # the published stats show the request while its steps run


def test_half_sent_headers_are_timed_out(edge_server: Server):
    address = urlparse(edge_server.url)
    with socket.create_connection((address.hostname, address.port), timeout=15) as conn:
        conn.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # never finished
        start = time.monotonic()
        try:
            data = conn.recv(1024)
        except TimeoutError:
            data = b"still open"
        assert data == b"", data
        assert time.monotonic() - start < 10
    with socket.create_connection((address.hostname, address.port), timeout=15) as conn:
        conn.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")  # a whole request is answered
        assert conn.recv(1024).startswith(b"HTTP/1.1 200")


def test_a_body_shorter_than_its_content_length_is_cut_off(edge_server: Server):
    address = urlparse(edge_server.url)
    with socket.create_connection((address.hostname, address.port), timeout=15) as conn:
        conn.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: 5000\r\n"
                     b"\r\n{\"text\": \"x\"")  # fmt: skip
        start = time.monotonic()
        try:
            while conn.recv(1024):  # whatever it answers, the connection must end
                pass
            closed = True
        except TimeoutError:
            closed = False
        assert closed and time.monotonic() - start < 10  # --header-timeout 1 here, between pieces
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
