"""The prefill's bootstrap server without an engine (issue 32): its authentication, its rank
table (a registered rank is never replaced by another process), its HTTP limits (short bodies
and silent clients cut off, a connection cap answered 503 by one loop)."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
from collections.abc import Iterator

import httpx
import pytest
from server_harness import wait_for

from dsaserve.disaggregation import bootstrap
from dsaserve.disaggregation.rank_table import RankTable

SECRET = "s3cret-for-the-cluster"
RANK = {"attn_tp_size": 1, "attn_tp_rank": 0, "attn_cp_size": 1, "attn_cp_rank": 0,
        "attn_dp_size": 1, "attn_dp_rank": 0, "pp_size": 1, "pp_rank": 0, "system_dp_size": 1,
        "system_dp_rank": 0, "rank_ip": "10.0.0.7", "rank_port": 4000, "page_size": 64,
        "kv_cache_dtype": "bf16", "dsaserve_session": "abc"}  # fmt: skip
ALL = "prefill_dp_rank=-1&prefill_cp_rank=-1&target_tp_rank=-1&target_pp_rank=-1"


@pytest.fixture
def server() -> Iterator[bootstrap.BootstrapServer]:
    running = bootstrap.BootstrapServer("127.0.0.1", 0, SECRET, header_timeout=1.0)
    try:
        yield running
    finally:
        running.close()


def url(server: bootstrap.BootstrapServer, path: str) -> str:
    return f"http://127.0.0.1:{server.port}{path}"


# ---- the rank table ------------------------------------------------------------------------
def test_a_registered_rank_is_replaced_only_by_its_own_registration_id() -> None:
    table = RankTable()
    status, first = table.register(dict(RANK))
    assert status == 200 and len(first["registration_id"]) == 32
    attacker = {**RANK, "rank_ip": "10.6.6.6", "rank_port": 6666}
    assert table.register(attacker)[0] == 409
    assert table.register({**attacker, "registration_id": "0" * 32})[0] == 409
    assert table.route({k: ["0"] for k in bootstrap.RANK_KEYS}) == (
        200, {"rank_ip": "10.0.0.7", "rank_port": 4000})  # fmt: skip
    moved = {**RANK, "rank_port": 4001, **first}  # the same process, on a new port
    assert table.register(moved) == (200, first)
    assert table.route({k: ["0"] for k in bootstrap.RANK_KEYS})[1]["rank_port"] == 4001


def test_every_rank_of_a_layout_registers_on_its_own() -> None:
    table, sizes = RankTable(), {"attn_tp_size": 2, "attn_dp_size": 2}
    ids = set()
    for dp in range(2):
        for tp in range(2):
            place = {"attn_tp_rank": tp, "attn_dp_rank": dp, "rank_port": 4000 + 2 * dp + tp}
            status, answer = table.register({**RANK, **sizes, **place})
            assert status == 200, answer
            ids.add(answer["registration_id"])
            assert table.ready() == (dp == tp == 1)
    assert len(ids) == 4
    query = {"prefill_dp_rank": ["1"], "prefill_cp_rank": ["0"], "target_tp_rank": ["1"],
             "target_pp_rank": ["0"]}  # fmt: skip
    assert table.route(query)[1]["rank_port"] == 4003
    assert table.register({**RANK, "attn_tp_size": 4, "attn_tp_rank": 3})[0] == 409  # layout


@pytest.mark.parametrize("change", [
    {"rank_ip": "0.0.0.0"}, {"rank_ip": "::"}, {"rank_ip": "a b"}, {"rank_ip": 7},
    {"rank_port": 0}, {"rank_port": 70000}, {"rank_port": "12x"}, {"rank_port": True},
    {"attn_tp_rank": 1}, {"attn_tp_size": 0}, {"page_size": -1}, {"kv_cache_dtype": [1]},
    {"dsaserve_session": {"a": 1}},
])  # fmt: skip
def test_bad_registrations_are_refused(change: dict) -> None:
    status, message = RankTable().register({**RANK, **change})
    assert status == 400 and "bad registration" in message


# ---- the HTTP server -------------------------------------------------------------------------
def test_route_needs_the_secret_health_does_not(server: bootstrap.BootstrapServer) -> None:
    assert httpx.get(url(server, "/health")).status_code == 200
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": SECRET}):
        assert httpx.get(url(server, f"/route?{ALL}"), headers=headers).status_code == 401
        assert httpx.put(url(server, "/route"), json=RANK, headers=headers).status_code == 401
    address = f"127.0.0.1:{server.port}"
    with pytest.raises(RuntimeError, match="refused"):
        bootstrap.register_rank(address, RANK, "wrong")
    assert bootstrap.register_rank(address, RANK, SECRET)
    assert bootstrap.query_route(address, (0, 0, 0, 0), SECRET)["rank_port"] == 4000
    with pytest.raises(RuntimeError, match="401"):
        bootstrap.query_route(address, (0, 0, 0, 0), None)


def test_body_limits(server: bootstrap.BootstrapServer) -> None:
    auth = {"Authorization": f"Bearer {SECRET}"}
    deep = b"[" * 2000 + b"]" * 2000
    answer = httpx.put(url(server, "/route"), content=deep, headers=auth)
    assert answer.status_code == 400 and "nested deeper" in answer.text
    big = json.dumps({**RANK, "pad": "x" * 70_000})
    assert httpx.put(url(server, "/route"), content=big, headers=auth).status_code == 413
    assert httpx.put(url(server, "/route"), content=b"{]", headers=auth).status_code == 400


def _connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=10)


def _closed_within(sock: socket.socket, seconds: float) -> bool:
    sock.settimeout(seconds)
    try:
        while sock.recv(1024):
            pass
        return True
    except TimeoutError:
        return False
    except ConnectionError:  # reset: closed too
        return True


def test_a_short_body_or_silent_client_is_cut_off(server: bootstrap.BootstrapServer) -> None:
    short = _connect(server.port)  # declares 500 bytes, sends 10, waits
    short.sendall(b"PUT /route HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + SECRET.encode()
                  + b"\r\nContent-Length: 500\r\n\r\n{\"a\": 1, ")  # fmt: skip
    silent = _connect(server.port)
    half = _connect(server.port)
    half.sendall(b"GET /route HTTP/1.1\r\nHost")
    # --header-timeout 1 here closes each; hang guard
    assert all(_closed_within(s, 120.0) for s in (short, silent, half))
    assert not RankTable.ready(server.table)  # the half body registered nothing


def _answer(sock: socket.socket) -> bytes:
    """Everything the server sends before it closes the connection."""
    sock.settimeout(120.0)  # hang guard
    data = b""
    with contextlib.suppress(ConnectionError):
        while chunk := sock.recv(1024):
            data += chunk
    return data


STALLED_BODY = (b"PUT /route HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + SECRET.encode()
                + b"\r\nContent-Length: 100\r\n\r\n{")  # fmt: skip


def test_stalled_clients_are_capped_without_threads() -> None:
    """Past the 64-connection cap a stalled client is answered 503 and closed, by the one loop
    (no thread per client). The header timeout here outlasts the test, so the first 64 stay open.
    Each over-cap client connects only once the server holds the 64 and reads its answer before
    the next connects: a burst of connects the loop has not yet accepted can overflow the listen
    backlog, and under SYN cookies the kernel then drops a silent client's connection unseen."""
    server = bootstrap.BootstrapServer("127.0.0.1", 0, SECRET, header_timeout=600.0)
    threads = threading.active_count()
    held = []
    try:
        for _ in range(bootstrap.MAX_CONNECTIONS):
            held.append(_connect(server.port))
            held[-1].sendall(STALLED_BODY)
        wait_for(lambda: len(_open_connections(server)) == bootstrap.MAX_CONNECTIONS, "the 64 held")
        assert threading.active_count() <= threads + 1  # uvicorn: one loop, no thread per client
        for _ in range(100):
            with _connect(server.port) as sock:
                answer = _answer(sock)
            assert answer.startswith(b"HTTP/1.1 503"), answer
        assert httpx.get(url(server, "/health"), timeout=5).status_code == 503
        assert all(_answer_pending(sock) for sock in held)  # the held 64 were never cut off
    finally:
        for sock in held:
            sock.close()
    try:
        # the server frees a closed client's slot when it reads its end
        wait_for(lambda: httpx.get(url(server, "/health"), timeout=5).status_code == 200,
                  "the closed clients still hold the cap")  # fmt: skip
    finally:
        server.close()


def _open_connections(server: bootstrap.BootstrapServer) -> set:
    return server.server.server_state.connections


def _answer_pending(sock: socket.socket) -> bool:
    """True when the connection is open and the server has sent nothing on it."""
    sock.setblocking(False)
    try:
        sock.recv(1, socket.MSG_PEEK)  # b"": closed; a byte: answered
        return False
    except BlockingIOError:
        return True
    finally:
        sock.setblocking(True)
