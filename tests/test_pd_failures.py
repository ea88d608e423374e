"""Disaggregation failures behind the real sglang-router: a broken transfer engine, a client that
disconnects, kill -9 of a prefill rank mid-transfer and mid-decode, a decode restart. Each ends in
an error in the API's shape (never a hang), both sides' KV back to idle, and new requests served.
The prefill runs `--tp 2 --dp 2 --enable-dp-attention`: room r is prefilled and written by group
r % 2's leader, rank 0 (the engine process) for even rooms, rank 1 (its child) for odd ones; the
kill mid-transfer kills the room's writer, once each: the other rank must follow it out, and no
process or shared-memory file of the prefill's is left."""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from pd_harness import (
    bootstrap_port,
    idle,
    launch,
    pd_flags,
    requires_nixl,
    requires_router,
    running_router,
    stats,
    stop_all,
)
from proc_sockets import alive
from server_harness import Server, _wait_ready, children, group_members, wait_for

pytestmark = [requires_router, requires_nixl]
HEARTBEAT = ["--disaggregation-heartbeat-interval", "0.5", "--disaggregation-timeout", "10"]
MESSAGES = [{"role": "user", "content": "Describe a quiet morning in a small mountain village."}]
LAYOUT = {"prefill": ["--tp", "2", "--dp", "2", "--enable-dp-attention"], "decode": []}
HANG_S = 120  # hang guards: an answer that takes longer than this is a hang, not a slow machine


class Cluster:
    """One prefill and one decode behind one router. The first start binds ports the OS picks
    (`--port 0`, `--disaggregation-bootstrap-port 0`); a restart binds the ports that start
    reported, so the router and the decode find the role again. Those ports were held by our own
    server until we killed it: another process could take one in between, a race the restart
    accepts because the router only knows a worker by its URL."""

    def __init__(self, checkpoint: Path, fault_file: Path) -> None:
        self.checkpoint, self.fault_file = checkpoint, fault_file
        self.bootstrap = 0
        self.ports = {"prefill": 0, "decode": 0}
        self.servers: dict[str, Server] = {}

    def start(self, *roles: str) -> None:
        for role in roles:
            flags = pd_flags(role, *HEARTBEAT, *LAYOUT[role], "--port", str(self.ports[role]),
                             bootstrap_port=self.bootstrap)  # fmt: skip
            self.servers[role] = launch(self.checkpoint, *flags, faults=self.fault_file)
        for role in roles:
            self.servers[role].url = _wait_ready(self.servers[role])
            self.ports[role] = int(self.servers[role].url.rsplit(":", 1)[1])
        if "prefill" in roles:
            self.bootstrap = bootstrap_port(self.servers["prefill"])

    def kill(self, role: str) -> None:
        pgid = self.servers[role].process.pid
        os.killpg(pgid, signal.SIGKILL)
        self.servers[role].process.wait(HANG_S)
        wait_for(lambda: not group_members(pgid), f"the {role}'s processes gone")

    def url(self, role: str) -> str:
        return f"http://127.0.0.1:{self.ports[role]}"

    def fault(self, mode: str) -> None:
        """Switch the servers' fault mode ("pause" first clears the last pause's marker)."""
        if mode == "pause":
            self.marker.unlink(missing_ok=True)
        self.fault_file.write_text(mode)

    @property
    def marker(self) -> Path:
        return self.fault_file.with_name(self.fault_file.name + ".paused")

    def paused(self) -> tuple[int, int] | None:
        """(pid, room) of the writer paused between a room's KV write and its aux write."""
        text = self.marker.read_text() if self.marker.exists() else ""
        return tuple(map(int, text.split())) if len(text.split()) == 2 else None

    def assert_idle(self) -> None:
        for role in ("prefill", "decode"):
            wait_for(lambda r=role: idle(self.url(r)), f"the {role} idle")
            info = httpx.get(self.url(role) + "/get_server_info").json()
            assert os.path.exists(f"/proc/{info['engine_pid']}"), f"the {role}'s engine is alive"


@pytest.fixture(scope="module")
def cluster(server_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    cluster = Cluster(server_checkpoint, tmp_path_factory.mktemp("pd_fault") / "fault")
    try:
        cluster.start("prefill", "decode")
        # --disable-retries: a dead decode's error comes back at once instead of after retries
        flags = ["--pd-disaggregation", "--prefill", cluster.url("prefill"),
                 str(cluster.bootstrap), "--decode", cluster.url("decode"),
                 "--disable-retries"]  # fmt: skip
        with running_router(*flags) as router:
            cluster.router = router
            yield cluster
    finally:
        stop_all(list(cluster.servers.values()))


@pytest.fixture(autouse=True)
def no_fault_after(cluster: Cluster) -> Iterator[None]:
    """A failed test leaves no fault switched on (a held pause would fail the next ones)."""
    yield
    cluster.fault("")


def _client(cluster: Cluster, **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster.router.base, api_key="none", max_retries=0, **kw)


def _served(cluster: Cluster) -> None:
    reply = _client(cluster).chat.completions.create(
        model="m", messages=MESSAGES, max_tokens=4, temperature=0
    )
    assert reply.usage.completion_tokens == 4


def test_broken_transfer_engine(cluster: Cluster) -> None:
    _served(cluster)
    failed = stats(cluster.url("decode"))["pd_rooms_failed"]
    cluster.fault("transfer")
    with pytest.raises(openai.InternalServerError) as error:
        _client(cluster, timeout=HANG_S).chat.completions.create(
            model="m", messages=MESSAGES, max_tokens=4
        )
    assert "fault injection: the transfer engine is broken" in str(error.value)
    cluster.fault("")
    cluster.assert_idle()
    assert stats(cluster.url("decode"))["pd_rooms_failed"] == failed + 1
    _served(cluster)


def _disconnect_mid_transfer(cluster: Cluster) -> int:
    """A streamed chat sent to the router over a bare socket, closed once the prefill is paused
    between the room's KV and aux writes (so both roles hold the room); returns the room."""
    body = json.dumps({"model": "m", "messages": MESSAGES, "max_tokens": 200,
                       "stream": True}).encode()  # fmt: skip
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
            f"application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()  # fmt: skip
    host, port = cluster.router.url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=HANG_S) as client:
        client.sendall(head + body)
        wait_for(lambda: cluster.paused() is not None, "the prefill's pause")
    return cluster.paused()[1]


def test_client_disconnect_at_the_router(cluster: Cluster) -> None:
    before = stats(cluster.url("decode"))["pd_rooms_aborted"]
    cluster.fault("pause")
    _disconnect_mid_transfer(cluster)
    aborted = lambda: stats(cluster.url("decode"))["pd_rooms_aborted"] > before  # noqa: E731
    wait_for(aborted, "the decode aborting the room")  # while the prefill is paused
    cluster.fault("")
    cluster.assert_idle()
    _served(cluster)


def _direct(cluster: Cluster, role: str, room: int, answers: dict) -> None:
    """One room sent to one role directly (as the router would), its answer kept."""
    body = {"text": MESSAGES[0]["content"], "sampling_params": {"max_new_tokens": 4},
            "bootstrap_host": "127.0.0.1", "bootstrap_port": cluster.bootstrap,
            "bootstrap_room": room}  # fmt: skip
    try:
        answers[role] = httpx.post(cluster.url(role) + "/generate", json=body, timeout=HANG_S)
    except httpx.HTTPError as e:
        answers[role] = e


def _rooms_per_group(cluster: Cluster) -> list[int]:
    return [g["pd_rooms_active"] for g in stats(cluster.url("prefill"))["dp_groups"]]


@pytest.mark.parametrize("group", [0, 1], ids=["rank0-writes", "rank1-writes"])
def test_kill_prefill_mid_decode_and_mid_transfer(cluster: Cluster, group: int) -> None:
    stream = _client(cluster).chat.completions.create(
        model="m", messages=MESSAGES, max_tokens=300, temperature=0, stream=True,
        extra_body={"ignore_eos": True}, stream_options={"include_usage": True},
    )  # fmt: skip
    first = next(iter(stream))  # decoding: its KV already moved
    cluster.fault("pause")
    answers: dict = {}
    room = 2**62 + 12344 + group  # prefilled by attention group room % 2
    senders = [threading.Thread(target=_direct, args=(cluster, role, room, answers))
               for role in ("prefill", "decode")]  # fmt: skip
    for t in senders:
        t.start()
    wait_for(lambda: cluster.paused() is not None, "the writer between KV and aux")
    writer, paused_room = cluster.paused()
    assert paused_room == room
    assert stats(cluster.url("decode"))["pd_rooms_active"] == 1, "the decode waits for it"
    want = [int(group == 0), int(group == 1)]  # published with the stats: waited for
    wait_for(lambda: _rooms_per_group(cluster) == want, f"the room in group {group}")
    info = httpx.get(cluster.url("prefill") + "/get_server_info", timeout=30).json()
    ranks = [info["engine_pid"], *children(info["engine_pid"])]
    assert len(ranks) == 2, "the prefill's two ranks, one group leader each"
    assert writer == ranks[group], "the room's group leader writes its pages"
    follower = ranks[1 - group]
    shm_before = set(os.listdir("/dev/shm"))
    os.kill(writer, signal.SIGKILL)  # the KV is written, the aux (and Success) never will be
    for t in senders:
        t.join(HANG_S)  # hang guard
        assert not t.is_alive(), "an answer for each role"
    # the decode noticed the lost prefill through its heartbeat (its /health polls of the
    # bootstrap server), not through a client and not by its 10 s timeout (a 504)
    assert answers["decode"].status_code == 503, answers["decode"].text
    message = answers["decode"].json()["error"]["message"]
    heartbeat = f"the prefill's bootstrap server 127.0.0.1:{cluster.bootstrap} stopped answering"
    assert message == heartbeat
    # the prefill's API process lives on and answers its request: the engine is gone
    assert answers["prefill"].status_code == 503, answers["prefill"]
    chunks = [first, *stream]  # the decoding request finishes on the decode alone
    assert chunks[-1].usage.completion_tokens == 300
    # the prefill's other rank followed its engine out; its API process stays, answering 503
    wait_for(lambda: not any(alive(pid) for pid in (writer, follower)), "the ranks gone")
    assert httpx.get(cluster.url("prefill") + "/health", timeout=10).status_code == 503
    cluster.kill("prefill")
    left = {f for f in set(os.listdir("/dev/shm")) - shm_before if f.startswith("dsaserve")}
    assert not left, left
    cluster.fault("")
    cluster.start("prefill")  # same ports; the decode registers with the new session
    cluster.assert_idle()
    _served(cluster)


def test_decode_restart(cluster: Cluster) -> None:
    cluster.kill("decode")
    with pytest.raises(openai.APIStatusError) as error:
        _client(cluster, timeout=HANG_S).chat.completions.create(
            model="m", messages=MESSAGES, max_tokens=4
        )
    # the router's own error for the unreachable decode, not the prefill's timeout (a 504)
    unreachable = f"Decode server error: error sending request for url ({cluster.url('decode')}/"
    assert error.value.status_code == 502 and unreachable in error.value.message, error.value
    cluster.start("decode")
    cluster.assert_idle()
    _served(cluster)
