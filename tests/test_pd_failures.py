"""Disaggregation failures behind the real sglang-router: a broken transfer engine, a client that
disconnects, kill -9 of a prefill rank mid-transfer and mid-decode, a decode restart. Each ends in
an error in the API's shape (never a hang), both sides' KV back to idle, and new requests served.
The prefill runs `--tp 2 --dp 2 --enable-dp-attention`: room r is prefilled and written by group
r % 2's leader, rank 0 (the engine process) for even rooms, rank 1 (its child) for odd ones; the
kill mid-transfer kills the room's writer, once each: the other rank must follow it out, and no
process or shared-memory file of the prefill's is left."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from pd_harness import (
    free_port,
    idle,
    launch,
    pd_flags,
    requires_nixl,
    requires_router,
    running_router,
    stats,
    stop_all,
    wait_for,
)
from proc_sockets import alive
from server_harness import Server, _wait_ready, children, group_members

pytestmark = [requires_router, requires_nixl]
HEARTBEAT = ["--disaggregation-heartbeat-interval", "0.5", "--disaggregation-timeout", "10"]
MESSAGES = [{"role": "user", "content": "Describe a quiet morning in a small mountain village."}]
LAYOUT = {"prefill": ["--tp", "2", "--dp", "2", "--enable-dp-attention"], "decode": []}


class Cluster:
    """One prefill and one decode on fixed ports (so they can restart), behind one router."""

    def __init__(self, checkpoint: Path, fault_file: Path) -> None:
        self.checkpoint, self.fault_file = checkpoint, fault_file
        self.bootstrap = free_port()
        self.ports = {"prefill": free_port(), "decode": free_port()}
        self.servers: dict[str, Server] = {}

    def start(self, *roles: str) -> None:
        env = {"DSASERVE_PD_FAULT_FILE": str(self.fault_file)}
        for role in roles:
            flags = pd_flags(role, self.bootstrap, *HEARTBEAT, *LAYOUT[role],
                             "--port", str(self.ports[role]))  # fmt: skip
            self.servers[role] = launch(self.checkpoint, *flags, env=env)
        for role in roles:
            self.servers[role].url = _wait_ready(self.servers[role])

    def kill(self, role: str) -> None:
        pgid = self.servers[role].process.pid
        os.killpg(pgid, signal.SIGKILL)
        self.servers[role].process.wait(10)
        wait_for(lambda: not group_members(pgid), 10, f"the {role}'s processes gone")

    def url(self, role: str) -> str:
        return f"http://127.0.0.1:{self.ports[role]}"

    def fault(self, mode: str) -> None:
        self.fault_file.write_text(mode)

    def assert_idle(self) -> None:
        for role in ("prefill", "decode"):
            wait_for(lambda r=role: idle(self.url(r)), 30, f"the {role} idle")
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


def _client(cluster: Cluster, **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster.router.base, api_key="none", max_retries=0, **kw)


def _served(cluster: Cluster) -> None:
    reply = _client(cluster).chat.completions.create(
        model="m", messages=MESSAGES, max_tokens=4, temperature=0
    )
    assert reply.usage.completion_tokens == 4


def test_broken_transfer_engine(cluster: Cluster) -> None:
    _served(cluster)
    cluster.fault("transfer")
    started = time.monotonic()
    with pytest.raises(openai.InternalServerError) as error:
        _client(cluster).chat.completions.create(model="m", messages=MESSAGES, max_tokens=4)
    assert time.monotonic() - started < 15
    assert "transfer" in str(error.value)
    cluster.fault("")
    cluster.assert_idle()
    assert stats(cluster.url("decode"))["pd_rooms_failed"] >= 1
    _served(cluster)


def test_client_disconnect_at_the_router(cluster: Cluster) -> None:
    before = {r: stats(cluster.url(r))["pd_rooms_aborted"] for r in ("prefill", "decode")}
    cluster.fault("delay:4")
    with pytest.raises(openai.APITimeoutError):
        _client(cluster, timeout=1.5).chat.completions.create(
            model="m", messages=MESSAGES, max_tokens=200, stream=True
        )
    cluster.fault("")
    cluster.assert_idle()
    after = {r: stats(cluster.url(r))["pd_rooms_aborted"] for r in ("prefill", "decode")}
    assert after["decode"] > before["decode"], "the decode aborted the room"
    _served(cluster)


def _direct(cluster: Cluster, role: str, room: int, answers: dict) -> None:
    """One room sent to one role directly (as the router would), its answer kept."""
    body = {"text": MESSAGES[0]["content"], "sampling_params": {"max_new_tokens": 4},
            "bootstrap_host": "127.0.0.1", "bootstrap_port": cluster.bootstrap,
            "bootstrap_room": room}  # fmt: skip
    try:
        answers[role] = httpx.post(cluster.url(role) + "/generate", json=body, timeout=60)
    except httpx.HTTPError as e:
        answers[role] = e


@pytest.mark.parametrize("group", [0, 1], ids=["rank0-writes", "rank1-writes"])
def test_kill_prefill_mid_decode_and_mid_transfer(cluster: Cluster, group: int) -> None:
    stream = _client(cluster).chat.completions.create(
        model="m", messages=MESSAGES, max_tokens=300, temperature=0, stream=True,
        extra_body={"ignore_eos": True}, stream_options={"include_usage": True},
    )  # fmt: skip
    first = next(iter(stream))  # decoding: its KV already moved
    cluster.fault("delay:6")
    answers: dict = {}
    room = 2**62 + 12344 + group  # prefilled by attention group room % 2
    senders = [threading.Thread(target=_direct, args=(cluster, role, room, answers))
               for role in ("prefill", "decode")]  # fmt: skip
    for t in senders:
        t.start()
    wait_for(lambda: stats(cluster.url("decode"))["pd_rooms_active"] == 1, 30, "a room")
    groups = stats(cluster.url("prefill"))["dp_groups"]
    assert [g["pd_rooms_active"] for g in groups] == [int(group == 0), int(group == 1)]
    info = httpx.get(cluster.url("prefill") + "/get_server_info", timeout=30).json()
    ranks = [info["engine_pid"], *children(info["engine_pid"])]
    assert len(ranks) == 2, "the prefill's two ranks, one group leader each"
    writer, follower = ranks[group], [ranks[1 - group]]
    shm_before = set(os.listdir("/dev/shm"))
    time.sleep(1.5)  # the prefill is now between the KV write and the aux write
    os.kill(writer, signal.SIGKILL)  # the rank that writes the room's pages
    killed = time.monotonic()
    for t in senders:
        t.join(30)
    # the decode noticed the lost prefill through its heartbeat, not through a client
    assert time.monotonic() - killed < 15
    assert answers["decode"].status_code == 503, answers["decode"].text
    assert "bootstrap server" in answers["decode"].json()["error"]["message"]
    # the prefill's API process lives on and answers its request: the engine is gone
    assert answers["prefill"].status_code == 503, answers["prefill"]
    chunks = [first, *stream]  # the decoding request finishes on the decode alone
    assert chunks[-1].usage.completion_tokens == 300
    # the prefill's other rank followed its engine out; its API process stays, answering 503
    wait_for(lambda: not any(alive(pid) for pid in [writer, *follower]), 30, "the ranks gone")
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
    started = time.monotonic()
    with pytest.raises(openai.APIStatusError):
        _client(cluster, timeout=30).chat.completions.create(
            model="m", messages=MESSAGES, max_tokens=4
        )
    assert time.monotonic() - started < 15
    cluster.start("decode")
    cluster.assert_idle()
    _served(cluster)
