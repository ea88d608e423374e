"""Issue 32 for the engine process and its ranks (`--tp 2`, real gloo ranks):

- what they open is this machine's alone: every TCP port the engine process and rank 1 listen on
  (the torch.distributed store, gloo's pairs) is bound to 127.0.0.1, never a wildcard; the
  API <-> engine sockets are `ipc://` files in a folder only this user may enter (0700), beside
  the ranks' heartbeat file (0600);
- rank 0's store keeps its keys under a name derived from the cluster secret: a process that
  reaches its port without the secret finds none of them;
- a stopped rank is not healthy (item 4): with the watchdog far away (120 s), SIGSTOP of rank 1,
  then of the engine process (rank 0), turns `/health` 503 within 5 s, naming the rank; SIGCONT
  brings 200 back and the server still answers; nothing outlives it.

And the engine process and rank 1 run with `GOMP_SPINCOUNT` set (runtime/omp.py) although the
server was started without one.
"""

from __future__ import annotations

import datetime
import os
import signal
from pathlib import Path
from types import SimpleNamespace

import httpx
import openai
import pytest
import torch.distributed as dist
from proc_sockets import alive, ipc_folder, listening
from server_harness import running_server, wait_for, wait_unhealthy
from tiny_models import make_checkpoint

from dsaserve import process_tree
from dsaserve.distributed.rendezvous import Endpoint, listen, rendezvous_store
from dsaserve.runtime.heartbeat import Heartbeats, start_beating
from dsaserve.runtime.omp import SPINCOUNT

PROMPT = [(7 * i + 3) % 300 + 1 for i in range(40)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("heartbeat") / "ckpt", "glm", seed=5)


def test_ranks_listen_on_loopback_and_a_stopped_rank_turns_health_503(
    checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    flags = ["--dtype", "float32", "--tp", "2", "--watchdog-timeout", "120"]
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)  # this process's LLM tests set it
    with running_server(checkpoint, *flags) as server:
        info = httpx.get(server.url + "/get_server_info", timeout=30).json()
        engine = info["engine_pid"]
        (rank1,) = [p.pid for p in process_tree.descendants(engine)]
        assert "GOMP_SPINCOUNT" not in _environ(server.process.pid)
        for pid in (engine, rank1):
            assert _environ(pid).get("GOMP_SPINCOUNT") == SPINCOUNT, pid
        tree = [p.pid for p in process_tree.descendants(server.process.pid)]
        ports = listening([engine, rank1])
        assert ports and all(host == "127.0.0.1" for host, _ in ports), ports
        folder = ipc_folder(server.process.pid)
        assert os.stat(folder).st_uid == os.getuid()
        assert os.stat(folder).st_mode & 0o777 == 0o700
        assert os.stat(Path(folder) / "heartbeat").st_mode & 0o777 == 0o600
        want = _complete(server)
        for pid, rank in ((rank1, 1), (engine, 0)):
            assert _health(server).status_code == 200
            os.kill(pid, signal.SIGSTOP)
            try:
                assert f"no heartbeat from rank {rank}" in wait_unhealthy(server)  # a 503
            finally:
                os.kill(pid, signal.SIGCONT)
            wait_for(lambda: _health(server).status_code == 200, "the rank beating, /health 200")
        assert _complete(server) == want  # the watchdog did not fire: still serving
    wait_for(lambda: not any(alive(pid) for pid in tree), "every process of the server gone")


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode().split("=", 1) for item in raw if b"=" in item)


def _health(server) -> httpx.Response:
    return httpx.get(server.url + "/health", timeout=10)


def _complete(server) -> str:
    client = openai.OpenAI(base_url=server.base, api_key="x", max_retries=0, timeout=120)
    r = client.completions.create(model="m", prompt=PROMPT, max_tokens=4, temperature=0,
                                  extra_body={"ignore_eos": True})  # fmt: skip
    return r.choices[0].text


def test_heartbeats_name_the_late_and_the_missing_rank(tmp_path: Path) -> None:
    path = str(tmp_path / "heartbeat")
    beats = [start_beating(path, 1)]  # rank 1 beats; rank 0 never wrote
    try:
        never = "no heartbeat from rank 0 (never)"  # once rank 1's first beat is written
        wait_for(lambda: Heartbeats(path, 2).late() == never, never)
        assert Heartbeats(path, 1).late() == never
        beats.append(start_beating(path, 0))
        wait_for(lambda: Heartbeats(path, 2).late() is None, "both ranks beating")
        assert "rank 1 (" in Heartbeats(path, 2).late(stale_s=-1.0)
        assert os.stat(path).st_mode & 0o777 == 0o600
        assert "cannot be read" in Heartbeats(str(tmp_path / "none"), 1).late()
    finally:
        for stop in beats:
            stop.set()


def test_the_rendezvous_store_listens_on_its_address_and_hides_its_keys() -> None:
    listener, where = listen(Endpoint("127.0.0.1", 0))  # rank 0 holds the port the OS gave
    port, wait = where.port, datetime.timedelta(seconds=20)
    args = SimpleNamespace(cluster_secret="rendezvous-secret", api_key=None)
    store = rendezvous_store(args, where, 0, 1, wait, listener)
    store.set("default_pg/0", "10.0.0.7:4242")  # what a rank publishes for its peers
    assert [(h, p) for h, p in listening([os.getpid()]) if p == port] == [("127.0.0.1", port)]
    outsider = dist.TCPStore("127.0.0.1", port, 1, False, wait)  # reaches the port, no secret
    assert not outsider.check(["default_pg/0"]) and not outsider.check(["dsaserve/default_pg/0"])
    other = SimpleNamespace(cluster_secret="another-secret", api_key=None)
    assert not rendezvous_store(other, where, 1, 1, wait).check(["default_pg/0"])
    assert rendezvous_store(args, where, 1, 1, wait).get("default_pg/0") == b"10.0.0.7:4242"
