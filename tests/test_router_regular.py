"""The real sglang-router (regular mode) over two plain `dsaserve serve` servers: the openai SDK
through round_robin and power_of_two, and `/get_load` steering power_of_two."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from pd_harness import launch, requires_router, running_router, stats, stop_all
from server_harness import Server, _wait_ready, wait_for, write_scripts

pytestmark = requires_router
MODEL = "glm-router-test"
# sglang-router 0.3.2 polls /get_load for power_of_two every --worker-startup-check-interval
# seconds (pd_harness passes 1); its debug log has this line after each poll
POLLED = "Fetched loads from 2 workers"
HOLD = {"text": "x" * 100_000, "chunk": 1, "delay": 0.05, "load": True, "finish": "length"}
MESSAGES = [{"role": "user", "content": "Tell me about the weather in Paris in spring, briefly."}]


@pytest.fixture(scope="module")
def pair(server_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory
         ) -> Iterator[tuple[Server, Server]]:  # fmt: skip
    """Two servers on one checkpoint; A has the `hold` script in front of its real engine."""
    scripts = write_scripts(tmp_path_factory.mktemp("router_scripts"), {"hold": HOLD})
    flags = ["--served-model-name", MODEL, "--max-total-tokens", "65536"]
    servers = [launch(server_checkpoint, *flags, scripts=scripts),
               launch(server_checkpoint, *flags)]  # fmt: skip
    try:
        for server in servers:
            server.url = _wait_ready(server)
        yield servers[0], servers[1]
    finally:
        stop_all(servers)


def test_extras_the_router_reads(pair: tuple[Server, Server]) -> None:
    a, _ = pair
    load = httpx.get(a.url + "/get_load").json()
    assert load == [{"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}]
    info = httpx.get(a.url + "/server_info").json()
    assert info["served_model_name"] == MODEL and Path(info["model_path"]).is_dir()
    assert httpx.get(a.url + "/model_info").json()["served_model_name"] == MODEL


def test_round_robin_chat(pair: tuple[Server, Server]) -> None:
    before = [stats(s.url)["prompt_tokens"] for s in pair]
    with running_router("--worker-urls", *(s.url for s in pair), "--policy", "round_robin") as r:
        client = openai.OpenAI(base_url=r.base, api_key="none")
        for _ in range(2):
            reply = client.chat.completions.create(
                model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0
            )
            assert reply.choices[0].finish_reason == "length"
            assert reply.usage.completion_tokens == 6
        chunks = list(client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0, stream=True,
            stream_options={"include_usage": True},
        ))  # fmt: skip
        assert chunks[-1].usage.completion_tokens == 6
        assert any(c.choices and c.choices[0].finish_reason == "length" for c in chunks)
    after = [stats(s.url)["prompt_tokens"] for s in pair]
    assert all(x > y for x, y in zip(after, before)), "round_robin used both servers"


def busy_load(server: Server) -> int:
    """Requests on `server` if its KV is in use too (what the router compares), else 0."""
    load = httpx.get(server.url + "/get_load").json()[0]
    return load["num_reqs"] if load["num_tokens"] > 0 else 0


def test_get_load_steers_power_of_two(pair: tuple[Server, Server]) -> None:
    """Busy server A (requests running, KV in use, as /get_load reports) gets none of the
    router's requests, and B's prompt tokens grow by exactly the router's. A is held busy by
    scripted requests that run until aborted and count in its load: real ones finish within a
    second here, and on a loaded machine the gap before a holder's next request let a poll see A
    idle."""
    a, b = pair
    holders = [threading.Thread(target=_hold, args=(a,)) for _ in range(2)]
    for t in holders:
        t.start()
    try:
        with running_router("--worker-urls", a.url, b.url, "--policy", "power_of_two",
                            "--log-level", "debug") as r:  # fmt: skip
            wait_for(lambda: busy_load(a) == len(holders), "A busy")
            before = stats(b.url)["prompt_tokens"]
            # the router's polls so far may have come before A was busy, and one may be under
            # way: the second one after this began after it
            polls = lambda: sum(POLLED in line for line in r.log)  # noqa: E731
            polled = polls()
            wait_for(lambda: polls() >= polled + 2, "two more load polls by the router")
            client = openai.OpenAI(base_url=r.base, api_key="none")
            sent = sum(
                client.completions.create(model=MODEL, prompt=f"hello {i}", max_tokens=2)
                .usage.prompt_tokens for i in range(4)
            )  # fmt: skip
            assert busy_load(a) == len(holders), "the holders kept A loaded"
            chose = "".join(line for line in r.log if "Power-of-two selection" in line)
            assert stats(b.url)["prompt_tokens"] - before == sent, (
                f"power_of_two sent a request to the loaded server:\n{chose}"
            )
    finally:
        httpx.post(a.url + "/abort_request", json={"abort_all": True}, timeout=30)
        for t in holders:
            t.join(timeout=120)  # hang guard
    assert not any(t.is_alive() for t in holders)


def _hold(server: Server) -> None:
    """One streamed request on `server` that its `hold` script runs until it is aborted."""
    busy = openai.OpenAI(base_url=server.base, api_key="none", max_retries=0)
    with contextlib.suppress(openai.APIError):
        for _ in busy.completions.create(model=MODEL, prompt="[[script:hold]] keep busy",
                                         max_tokens=900, stream=True):  # fmt: skip
            pass
