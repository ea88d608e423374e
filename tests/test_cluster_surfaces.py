"""Issue 32, the parts without an engine: defensive parsing of every PD frame (hypothesis); CURVE
between ZMQ peers (the cross-node engine sockets too); where internal surfaces listen and what
they advertise. The bootstrap server's authentication, rank table and HTTP limits:
tests/test_bootstrap_server.py."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dsaserve.args import ServerArgs
from dsaserve.cluster import addresses
from dsaserve.cluster.secret import cluster_secret
from dsaserve.cluster.zmq_auth import ZmqAuth
from dsaserve.disaggregation import kv_regions
from dsaserve.disaggregation.protocol import (
    MAX_INDEX,
    MAX_ROOM,
    FrameError,
    KVPoll,
    Registration,
    Status,
    TransferInfo,
    parse_to_prefill,
)
from dsaserve.runtime import ipc
from dsaserve.server.dp_controller import DPEngineClient

SECRET = "s3cret-for-the-cluster"


# ---- frames ----------------------------------------------------------------------------------
def _register_frames(layout: dict) -> list[bytes]:
    return Registration("tcp://10.0.0.1:5000", "agent", b"meta", layout).frames()


FRAMES = st.one_of(
    st.lists(st.binary(max_size=64), max_size=7),
    st.builds(lambda f, i: [b"REGISTER", *f][:i], st.lists(st.binary(max_size=40), max_size=6),
              st.integers(0, 7)),
    st.builds(lambda room, pages, aux: [room, b"tcp://1.2.3.4:5", b"a", pages, aux],
              st.one_of(st.binary(max_size=24), st.integers(-2**70, 2**70).map(
                  lambda n: str(n).encode())),
              st.binary(max_size=41), st.integers(-2**40, 2**40).map(lambda n: str(n).encode())),
    st.builds(lambda room, ep: [b"ABORT", room, ep], st.binary(max_size=24),
              st.sampled_from([b"tcp://x:1", b"tcp://x:0", b"udp://x:1", b"tcp://:", b"\xff"])),
)  # fmt: skip


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(FRAMES)
def test_prefill_frames_parse_or_raise_frame_error(frames: list[bytes]) -> None:
    try:
        message = parse_to_prefill(frames)
    except FrameError:
        return
    if isinstance(message, TransferInfo):
        assert 0 <= message.room < 2**63 and min(message.pages, default=0) >= 0
    if isinstance(message, Registration):
        kv_regions.mismatch({}, message.layout)  # a malformed layout is named, never raised


@settings(max_examples=300, deadline=None)
@given(st.lists(st.binary(max_size=40), max_size=6), st.integers(0, 5))
def test_status_frames_parse_or_raise_frame_error(frames: list[bytes], junk_at: int) -> None:
    """Junk (alone, or after a good status's first parts) is refused with a FrameError or parses
    to a status in range that survives its own round trip."""
    good = Status(7, KVPoll.Success, 0, {"bytes": 1})
    assert Status.parse(good.frames()) == good
    for candidate in (frames, good.frames()[:junk_at] + frames[: 4 - junk_at]):
        try:
            parsed = Status.parse(candidate)
        except FrameError:
            continue
        assert 0 <= parsed.room <= MAX_ROOM and 0 <= parsed.rank <= MAX_INDEX, parsed
        assert isinstance(parsed.status, KVPoll) and isinstance(parsed.detail, dict), parsed
        assert Status.parse(parsed.frames()) == parsed


DETAILS = st.dictionaries(st.text(max_size=8), st.one_of(st.integers(), st.text(max_size=8)),
                          max_size=3)  # fmt: skip


@settings(max_examples=200, deadline=None)
@given(st.integers(0, MAX_ROOM), st.sampled_from(KVPoll), st.integers(0, MAX_INDEX), DETAILS)
def test_good_status_frames_round_trip(room: int, poll: KVPoll, rank: int, detail: dict) -> None:
    """Every status a peer can send parses back to itself (the three-part form: no detail)."""
    status = Status(room, poll, rank, detail)
    assert Status.parse(status.frames()) == status
    assert Status.parse(status.frames()[:3]) == Status(room, poll, rank, {})


def test_frames_name_what_is_wrong() -> None:
    info = TransferInfo(5, "tcp://10.0.0.1:5000", "agent", [1, 2], 3).frames()
    cases = {
        "4 parts, expected 5": info[:4],
        "not an integer": [b"1_0", *info[1:]],
        "int32 each": [*info[:3], b"abc", info[4]],
        "negative page": [*info[:3], b"\xff\xff\xff\xff", info[4]],
        "not a tcp://host:port": [info[0], b"tcp://10.0.0.1:99999", *info[2:]],
        "not an object": [*_register_frames({})[:4], b"[1]"],
    }
    for expected, frames in cases.items():
        with pytest.raises(FrameError, match=expected):
            parse_to_prefill(frames)
    assert "malformed" in kv_regions.mismatch({}, {"kv_ptr": "0x10"})


# ---- CURVE between ZMQ peers -----------------------------------------------------------------
def _push_pull(server_secret: str | None, client_secret: str | None) -> list | None:
    """What a PULL (the server's auth) receives from a PUSH (the client's auth) within 1.5 s."""
    contexts = zmq.Context(), zmq.Context()
    auths = ZmqAuth(contexts[0], server_secret), ZmqAuth(contexts[1], client_secret)
    pull = auths[0].serve(contexts[0].socket(zmq.PULL))
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    push = auths[1].dial(contexts[1].socket(zmq.PUSH))
    push.connect(f"tcp://127.0.0.1:{port}")
    push.send_multipart([b"hello", b"world"])
    got = pull.recv_multipart() if pull.poll(1500) else None
    for sock in (push, pull):
        sock.close(linger=0)
    for auth, context in zip(auths, contexts):
        auth.close()
        context.term()
    return got


def test_curve_admits_only_the_secret() -> None:
    assert _push_pull(SECRET, SECRET) == [b"hello", b"world"]
    assert _push_pull(SECRET, "another secret") is None
    assert _push_pull(SECRET, None) is None  # a plain client never completes the handshake
    assert _push_pull(None, None) == [b"hello", b"world"]  # no secret: plain (loopback only)


def test_the_cross_node_engine_sockets_admit_only_the_secret() -> None:
    """DP attention across nodes: the API process's TCP request and output sockets
    (runtime/ipc.py) are CURVE servers. A group leader with another secret, or none, never
    completes the handshake (no request reaches it, its outputs never arrive); one with the
    secret exchanges frames both ways."""
    assert asyncio.run(_engine_sockets()) == [False, False, True]


async def _engine_sockets() -> list[bool]:
    paths = ipc.IpcPaths.tcp("127.0.0.1", 2)
    client = DPEngineClient(paths, 2, secret=SECRET)
    delivered = []
    try:
        for secret in ("another secret", None, SECRET):
            context = zmq.Context()
            auth = ipc.auth_sockets(context, paths, secret)
            inbox = ipc.dial_socket(auth, context.socket(zmq.PULL))
            inbox.connect(paths.for_group(1).to_engine)
            outbox = ipc.dial_socket(auth, context.socket(zmq.PUSH))
            outbox.connect(paths.from_engine)
            request = bool(client.sockets[1].poll(1500, zmq.POLLOUT))  # a handshake completed
            if request:
                client.sockets[1].send(ipc.encode(ipc.Abort(["r"])))
                assert inbox.poll(5000)
                assert ipc.decode_to_engine(inbox.recv()) == ipc.Abort(["r"])
            with contextlib.suppress(zmq.Again):  # no pipe (a refused handshake): not sent
                outbox.send(ipc.encode(ipc.Fatal("m")), zmq.NOBLOCK)
            output = bool(await client.from_engine.poll(1500))
            if output:
                assert ipc.decode_from_engine(await client.from_engine.recv()) == ipc.Fatal("m")
            assert request == output
            delivered.append(request)
            for sock in (inbox, outbox):
                sock.close(linger=0)
            if auth is not None:
                auth.close()
            context.term()
    finally:
        client.close()
        paths.cleanup(2)
    return delivered


# ---- where surfaces listen and what they advertise ---------------------------------------------
def _args(*argv: str) -> ServerArgs:
    return ServerArgs.from_cli(list(argv))


def test_the_secret_defaults_to_the_api_key_and_stays_out_of_reprs(monkeypatch) -> None:
    monkeypatch.delenv("DSASERVE_CLUSTER_SECRET", raising=False)
    monkeypatch.setenv("SGLANG_DISAGGREGATION_BOOTSTRAP_AUTH_TOKEN", "from-sglang")
    assert cluster_secret(_args()) == "from-sglang"
    monkeypatch.setenv("DSASERVE_CLUSTER_SECRET", "from-env")
    assert cluster_secret(_args("--api-key", "k")) == "from-env"
    monkeypatch.delenv("DSASERVE_CLUSTER_SECRET")
    monkeypatch.delenv("SGLANG_DISAGGREGATION_BOOTSTRAP_AUTH_TOKEN")
    assert cluster_secret(_args("--api-key", "the-api-key")) == "the-api-key"
    args = _args("--api-key", "the-api-key", "--cluster-secret", "the-secret")
    assert cluster_secret(args) == "the-secret"
    assert "the-secret" not in repr(args) and "the-api-key" not in repr(args)


def test_exposure_is_refused_without_a_secret(monkeypatch) -> None:
    for name in ("DSASERVE_CLUSTER_SECRET", "SGLANG_DISAGGREGATION_BOOTSTRAP_AUTH_TOKEN",
                 "DSASERVE_API_KEY"):  # fmt: skip
        monkeypatch.delenv(name, raising=False)
    pd = ["--disaggregation-mode", "prefill"]
    assert "--cluster-secret" in addresses.exposure_error(_args("--host", "0.0.0.0", *pd))
    assert addresses.exposure_error(_args("--host", "127.0.0.2", *pd)) is None
    assert addresses.exposure_error(_args("--host", "0.0.0.0")) is None  # no internal port
    far = _args("--dist-init-addr", "10.1.2.3:5000", "--tp", "2")
    assert "torch.distributed" in addresses.exposure_error(far)
    assert addresses.exposure_error(_args("--host", "0.0.0.0", "--api-key", "k", *pd)) is None
    assert addresses.internal_host(_args("--host", "0.0.0.0", *pd)) == "127.0.0.1"
    assert addresses.internal_host(_args("--host", "0.0.0.0", "--cluster-secret", "s")) == "0.0.0.0"


def test_the_advertised_address_is_never_a_wildcard(monkeypatch) -> None:
    for name in addresses.ADVERTISE_ENVS:
        monkeypatch.delenv(name, raising=False)
    wild = ("--host", "0.0.0.0")
    assert addresses.advertise_host(_args("--host", "127.0.0.9")) == "127.0.0.9"
    assert addresses.advertise_host(_args(*wild, "--disaggregation-advertise-host", "h1")) == "h1"
    node0 = _args(*wild, "--dist-init-addr", "127.0.0.2:5000")
    assert addresses.advertise_host(node0) == "127.0.0.2"  # node 0: its own address there
    assert addresses.advertise_host(_args(*wild), peer="127.0.0.2") == "127.0.0.1"  # the route
    assert addresses.advertise_host(_args(*wild)) == addresses.route_source("192.0.2.1")
    monkeypatch.setenv("SGLANG_HOST_IP", "10.9.8.7")
    assert addresses.advertise_host(_args(*wild)) == "10.9.8.7"
    assert addresses.tcp_endpoint("::1", 5) == "tcp://[::1]:5"


def test_interfaces_are_found_by_address() -> None:
    assert addresses.interface_of("127.0.0.2") == addresses.interface_of("127.0.0.1") == "lo"
    outward = addresses.route_source("192.0.2.1")
    if outward and not addresses.is_loopback(outward):  # a machine with a default route
        assert addresses.interface_of(outward) not in (None, "lo")
    assert addresses.interface_of("203.0.113.77") is None  # not an address of this machine
