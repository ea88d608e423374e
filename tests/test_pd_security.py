"""Issue 32 end to end, behind the real sglang-router with NIXL: a prefill and a decode on two
addresses of this machine (127.0.0.2, 127.0.0.3) with `--host 0.0.0.0` and a cluster secret, plus
a second prefill with other weights (the attacker's, holding the secret too).

- A second process cannot take over the prefill's registered rank (401 without the secret, 409
  with it), and the client's answer is the real prefill's, token for token.
- The decode reaches the prefill at the address the prefill advertised, and the prefill the
  decode at the one the decode advertised (their TCP connections show it).
- Random frames of every PD message type (hypothesis), from a peer holding the secret, end no
  engine: each is dropped and counted; the next real request is served the same.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import psutil
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pd_harness import (
    PD_ENV,
    bootstrap_port,
    idle,
    pd_flags,
    requires_nixl,
    requires_router,
    running_router,
    running_servers,
)
from server_harness import make_server_checkpoint, wait_for

from dsaserve import LLM, SamplingParams
from dsaserve.cluster.zmq_auth import ZmqAuth

pytestmark = [requires_router, requires_nixl]
SECRET = "pd-cluster-secret-for-the-tests"
AUTH = {"Authorization": f"Bearer {SECRET}"}
PROMPT_IDS = [(7 * i + 3) % 150 + 10 for i in range(40)]  # > one page, > index_topk
FIRST_RANK = "prefill_dp_rank=0&prefill_cp_rank=0&target_tp_rank=0&target_pp_rank=0"
FUZZ = settings(max_examples=150, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture])  # fmt: skip


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    real = make_server_checkpoint(tmp_path_factory.mktemp("pd_sec_real"))
    return real, make_server_checkpoint(tmp_path_factory.mktemp("pd_sec_attacker"), seed=1)


@pytest.fixture(scope="module")
def cluster(checkpoints: tuple[Path, Path]) -> Iterator[dict]:
    real, other = checkpoints
    env = {"DSASERVE_CLUSTER_SECRET": SECRET}
    wild = ["--host", "0.0.0.0"]
    # --dist-init-addr only gives the prefill's advertised host: a one-rank server starts no
    # rendezvous, so nothing binds its port (1, which nothing else may bind either)
    specs = [
        (real, pd_flags("prefill", *wild, "--dist-init-addr", "127.0.0.2:1"), env),
        (real, pd_flags("decode", *wild, "--disaggregation-advertise-host", "127.0.0.3"), env),
        (other, pd_flags("prefill", "--host", "127.0.0.4"), env),
    ]
    with running_servers(specs) as (prefill, decode, attacker):
        boot, other_boot = bootstrap_port(prefill), bootstrap_port(attacker)
        port = lambda s: s.url.rsplit(":", 1)[1]  # noqa: E731
        urls = {"prefill": f"http://127.0.0.2:{port(prefill)}",
                "decode": f"http://127.0.0.3:{port(decode)}", "attacker": attacker.url}  # fmt: skip
        flags = ["--pd-disaggregation", "--prefill", urls["prefill"], str(boot), "--decode",
                 urls["decode"]]  # fmt: skip
        with running_router(*flags) as router:
            yield {**urls, "router": router.url, "boot": f"127.0.0.2:{boot}",
                   "attacker_boot": f"127.0.0.4:{other_boot}"}  # fmt: skip


def greedy_ids(checkpoint: Path) -> list[int]:
    with LLM(str(checkpoint), page_size=16, max_total_tokens=4096) as llm:
        return llm.generate([PROMPT_IDS], SamplingParams(temperature=0, max_tokens=8),
                            use_tqdm=False)[0].token_ids  # fmt: skip


def generate(router: str) -> list[int]:
    body = {"input_ids": PROMPT_IDS, "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
    answer = httpx.post(router + "/generate", json=body, timeout=120)
    assert answer.status_code == 200, answer.text
    return answer.json()["output_ids"]


def info(url: str) -> dict:
    return httpx.get(url + "/get_server_info", timeout=30).json()


def test_a_registered_rank_cannot_be_taken_over(cluster: dict, checkpoints) -> None:
    real, other = (greedy_ids(c) for c in checkpoints)
    assert real != other  # so an answer from the attacker's prefill would show
    theirs = httpx.get(f"http://{cluster['attacker_boot']}/route?{FIRST_RANK}", headers=AUTH)
    forged = {"attn_tp_size": 1, "attn_tp_rank": 0, "attn_cp_size": 1, "attn_cp_rank": 0,
              "attn_dp_size": 1, "attn_dp_rank": 0, "pp_size": 1, "pp_rank": 0,
              "page_size": 16, "kv_cache_dtype": "torch.float32", **theirs.json()}  # fmt: skip
    route = f"http://{cluster['boot']}/route"
    takeover = """import httpx, json, sys
for headers in ({}, {"Authorization": "Bearer wrong"}, json.loads(sys.argv[3])):
    print(httpx.put(sys.argv[1], content=sys.argv[2], headers=headers).status_code)"""
    argv = [sys.executable, "-c", takeover, route, json.dumps(forged), json.dumps(AUTH)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert done.stdout.split() == ["401", "401", "409"], done.stderr  # another process: refused
    mine = httpx.get(f"{route}?{FIRST_RANK}", headers=AUTH).json()
    assert mine["rank_ip"] == "127.0.0.2" and mine["rank_port"] != theirs.json()["rank_port"]
    assert httpx.get(f"{route}?{FIRST_RANK}").status_code == 401  # no secret, no route
    assert generate(cluster["router"]) == real  # the real prefill's KV and first token
    client = openai.OpenAI(base_url=cluster["router"] + "/v1", api_key="none", max_retries=0)
    messages = [{"role": "user", "content": "What is 15% of 240?"}]
    reply = client.chat.completions.create(model="pd", max_tokens=6, temperature=0,
                                           messages=messages)  # fmt: skip
    assert reply.choices[0].finish_reason in ("stop", "length")
    attacker = info(cluster["attacker"])["internal_states"][0]
    assert attacker["pd_peers"] == [] and attacker["pd_rooms_ok"] == 0  # never reached


def _connections(url: str) -> set[tuple[str, int]]:
    pid = info(url)["engine_pid"]
    return {c.raddr for c in psutil.Process(pid).net_connections("tcp") if c.raddr}


def test_each_role_reaches_the_other_at_its_advertised_address(cluster: dict) -> None:
    generate(cluster["router"])
    prefill = info(cluster["prefill"])["internal_states"][0]
    decode = info(cluster["decode"])["internal_states"][0]
    assert prefill["pd_endpoint"].startswith("tcp://127.0.0.2:")  # from --dist-init-addr's host
    assert decode["pd_endpoint"].startswith("tcp://127.0.0.3:")  # --disaggregation-advertise-host
    assert prefill["pd_peers"] == [decode["pd_endpoint"]]
    assert decode["pd_peers"] == [prefill["pd_endpoint"]]
    host_port = lambda e: (e[6:].rsplit(":", 1)[0], int(e.rsplit(":", 1)[1]))  # noqa: E731
    assert host_port(prefill["pd_endpoint"]) in _connections(cluster["decode"])
    assert host_port(decode["pd_endpoint"]) in _connections(cluster["prefill"])


def _without_secret() -> dict:
    drop = ("DSASERVE_CLUSTER_SECRET", "SGLANG_DISAGGREGATION_BOOTSTRAP_AUTH_TOKEN",
            "DSASERVE_API_KEY")  # fmt: skip
    return {k: v for k, v in {**os.environ, **PD_ENV}.items() if k not in drop}


def test_without_a_secret_it_will_not_listen_beyond_loopback(checkpoints) -> None:
    command = [sys.executable, "-m", "dsaserve.cli", "serve", "--model-path", str(checkpoints[0]),
               "--disaggregation-mode", "prefill", "--host", "0.0.0.0", "--port", "0"]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=120,
                          env=_without_secret())  # fmt: skip
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "--cluster-secret" in lines[0] and "loopback" in lines[0], lines


# ---- every frame type, fuzzed, at both running roles ------------------------------------------
INTS = st.one_of(st.integers(-(2**70), 2**70), st.sampled_from([0, 1, 2**31, 2**63, -1]))
ASCII_INT = INTS.map(lambda n: str(n).encode())
PART = st.one_of(st.binary(max_size=48), ASCII_INT, st.just(b""))
ENDPOINT = st.sampled_from([b"tcp://127.0.0.1:9", b"tcp://127.0.0.3:1", b"tcp://x:0", b"\xff"])
LAYOUT_KEYS = ["kv_ptr", "kv_layers", "slots", "page_size", "dtype", "mtp", "kv_kind", "aux_slots"]
VALUE = st.one_of(INTS, st.text(max_size=8), st.booleans(), st.none())
LAYOUT = st.dictionaries(st.sampled_from(LAYOUT_KEYS), VALUE)
TO_PREFILL = st.one_of(
    st.lists(PART, min_size=1, max_size=7),
    st.tuples(ENDPOINT, PART, PART, LAYOUT).map(
        lambda t: [b"REGISTER", t[0], t[1], t[2], json.dumps(t[3]).encode()]),
    st.tuples(ASCII_INT, ENDPOINT, PART, st.binary(max_size=64), ASCII_INT).map(list),
    st.tuples(ASCII_INT, ENDPOINT).map(lambda t: [b"ABORT", *t]),
)  # fmt: skip
DETAIL = st.one_of(st.binary(max_size=32), st.dictionaries(
    st.sampled_from(["bytes", "seconds", "checksums", "reason"]),
    st.one_of(INTS, st.text(max_size=8), st.lists(st.text(max_size=4), max_size=3), st.none()),
).map(lambda d: json.dumps(d).encode()))  # fmt: skip
STATUS = st.tuples(ASCII_INT, ASCII_INT, ASCII_INT, DETAIL).map(list)
TO_DECODE = st.one_of(st.lists(PART, min_size=1, max_size=6), STATUS)


@contextlib.contextmanager
def peer(endpoint: str) -> Iterator[zmq.Socket]:
    """A PUSH socket holding the secret (so frames get past CURVE to the parser)."""
    context = zmq.Context()
    auth = ZmqAuth(context, SECRET)
    sock = auth.dial(context.socket(zmq.PUSH))
    sock.connect(endpoint)
    try:
        yield sock
    finally:
        sock.close(linger=2000)
        auth.close()
        context.term()


def test_fuzzed_frames_end_no_engine(cluster: dict) -> None:
    before = {r: info(cluster[r]) for r in ("prefill", "decode")}
    answer = generate(cluster["router"])
    for role, strategy in (("prefill", TO_PREFILL), ("decode", TO_DECODE)):
        endpoint = before[role]["internal_states"][0]["pd_endpoint"]
        with peer(endpoint) as sock:
            send = given(strategy)(lambda frames: sock.send_multipart(frames))
            FUZZ(send)()
        wait_for(lambda r=role: _dropped(cluster[r]) >= 50, f"the {role} dropping frames")
    FUZZ(given(st.binary(max_size=2000))(lambda body: _bootstrap_put(cluster, body)))()
    after = {r: info(cluster[r]) for r in ("prefill", "decode")}
    assert all(after[r]["engine_pid"] == before[r]["engine_pid"] for r in after)  # no death
    assert generate(cluster["router"]) == answer
    for role in ("prefill", "decode"):
        assert httpx.get(cluster[role] + "/health", timeout=10).status_code == 200
        wait_for(lambda r=role: idle(cluster[r]), f"the {role} idle")


def _dropped(url: str) -> int:
    return info(url)["internal_states"][0]["pd_frames_dropped"]


def _bootstrap_put(cluster: dict, body: bytes) -> None:
    answer = httpx.put(f"http://{cluster['boot']}/route", content=body, headers=AUTH, timeout=10)
    assert answer.status_code in (400, 409, 413), answer.text
