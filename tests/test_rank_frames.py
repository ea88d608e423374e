"""Issue 32, item 2, for the engine process and its ranks: random frames on every channel between
the processes of a server with real ranks (`--tp 2`, and `--tp 2 --dp 2 --enable-dp-attention`)
end no process, and the next real request is answered token for token as before.

The test plays the API process with the real clients (`EngineClient`, DP attention's
`DPEngineClient`) in front of the real engine process and its ranks (gloo, OS-picked ports), and
sends (hypothesis: random bytes, truncated messages, wrong counts and types, huge numbers):

- to each engine's request socket (rank 0's, and under DP attention group 1's leader, a rank);
- to the controller's output socket (what the engines send back; a `Fatal` is the engine's own
  death notice and is left out);
- to every TCP port the engine process and its ranks listen on (the torch.distributed store and
  gloo's pairs).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from pathlib import Path

import msgspec
import pytest
import zmq
from fuzz_seed import run_seeded
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from proc_sockets import alive, listening
from server_harness import wait_for
from tiny_models import make_checkpoint

from dsaserve import process_tree
from dsaserve.args import ServerArgs
from dsaserve.engine.messages import GenerateRequest
from dsaserve.runtime import ipc
from dsaserve.server.dp_controller import DPEngineClient
from dsaserve.server.engine_client import EngineClient
from dsaserve.server.engine_processes import start_engines, stop_engines

PROMPTS = [[(7 * i + 3) % 300 + 1 for i in range(40)], [5, 17, 99, 3, 250, 8, 1]]
SAMPLING = {"max_tokens": 6, "temperature": 0.0, "ignore_eos": True}
LAYOUTS = {
    "tp2": ["--tp", "2"],
    "dp_attention": ["--tp", "2", "--dp", "2", "--enable-dp-attention"],
}
FUZZ = settings(max_examples=120, deadline=None, database=None,
                suppress_health_check=list(HealthCheck))  # fmt: skip
FUZZ_RIDS: list[str] = []  # every rid a fuzzed Submit may have admitted, aborted afterwards

INTS = st.one_of(st.integers(-(2**70), 2**70), st.sampled_from([0, -1, 2**31, 2**63, 2**64]))
SCALAR = st.one_of(INTS, st.floats(allow_nan=True), st.text(max_size=6), st.booleans(), st.none())
SAMPLING_FIELDS = ["max_tokens", "min_tokens", "temperature", "top_p", "top_k", "min_p", "seed",
                   "repetition_penalty", "stop", "stop_token_ids", "logprobs", "n", "regex",
                   "json_schema", "ignore_eos", "grammar_after_token_id", "bogus"]  # fmt: skip
FIELD_VALUE = st.one_of(SCALAR, st.lists(SCALAR, max_size=4))


def _request(rid: str, ids: list, sampling: dict, stream: object) -> dict:
    FUZZ_RIDS.append(rid)
    return {"rid": rid, "input_ids": ids, "sampling": {**SAMPLING, **sampling}, "stream": stream}


REQUEST = st.builds(
    _request,
    st.text(min_size=1, max_size=8).map(lambda s: "fuzz-" + s),
    st.one_of(
        st.lists(INTS, max_size=12), st.lists(st.integers(0, 400), max_size=40), st.just([]), SCALAR
    ),
    st.dictionaries(st.sampled_from(SAMPLING_FIELDS), FIELD_VALUE, max_size=4),
    st.one_of(st.booleans(), SCALAR),
)
ANY = st.one_of(SCALAR, st.lists(SCALAR, max_size=3), st.dictionaries(st.text(max_size=4), SCALAR))
TO_ENGINE_OBJECTS = st.one_of(
    st.builds(lambda rs: {"type": "Submit", "requests": rs}, st.lists(REQUEST, max_size=3)),
    st.builds(lambda rs: {"type": "Submit", "requests": rs}, ANY),
    st.builds(lambda rids: {"type": "Abort", "rids": rids}, st.one_of(st.lists(SCALAR), ANY)),
    st.builds(
        lambda i, op: {"type": "Control", "id": i, "op": op},
        INTS,
        st.one_of(st.sampled_from(["stats", "info", "flush_cache"]), SCALAR),
    ),
    st.builds(
        lambda t, body: {"type": t, **body},
        st.text(max_size=8),
        st.dictionaries(st.text(max_size=6), ANY, max_size=3),
    ),
)
FROM_ENGINE_OBJECTS = st.one_of(
    st.builds(
        lambda s, g: {"type": "Stats", "stats": s, "group": g},
        st.one_of(st.dictionaries(st.text(max_size=8), SCALAR), ANY),
        INTS,
    ),
    st.builds(
        lambda outs: {"type": "Outputs", "outputs": outs},
        st.one_of(
            ANY,
            st.lists(
                st.dictionaries(
                    st.sampled_from(["rid", "token_ids", "text", "finished"]), FIELD_VALUE
                ),
                max_size=3,
            ),
        ),
    ),
    st.builds(
        lambda r, m, s: {"type": "Rejected", "rids": r, "message": m, "status": s},
        st.one_of(st.lists(st.text(max_size=4)), ANY),
        SCALAR,
        INTS,
    ),
    st.builds(lambda i, r: {"type": "ControlReply", "id": i, "result": r}, INTS, ANY),
    st.builds(lambda info: {"type": "Ready", "info": info}, ANY),
)


def _frames(objects: st.SearchStrategy) -> st.SearchStrategy[bytes]:
    """Random bytes, msgpack of `objects`, and truncations of those."""
    packed = objects.map(_pack)
    cut = st.tuples(packed, st.integers(0, 200)).map(lambda t: t[0][: t[1]])
    return st.one_of(st.binary(max_size=300), packed, cut)


def _pack(value: object) -> bytes:
    try:
        return msgspec.msgpack.encode(value)
    except (OverflowError, TypeError):  # an integer beyond 64 bits: its text instead
        return msgspec.msgpack.encode(repr(value))


TO_ENGINE = _frames(TO_ENGINE_OBJECTS)
FROM_ENGINE = _frames(FROM_ENGINE_OBJECTS)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("rank_frames") / "ckpt", "glm", seed=4)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_random_frames_end_no_engine_and_no_rank(checkpoint: Path, layout: str) -> None:
    argv = ["--model-path", str(checkpoint), "--dtype", "float32", "--page-size", "16",
            "--max-total-tokens", "4096", "--watchdog-timeout", "120"]  # fmt: skip
    argv += LAYOUTS[layout]
    asyncio.run(_fuzz(ServerArgs.from_cli(argv)))


async def _fuzz(args: ServerArgs) -> None:
    paths = ipc.IpcPaths.fresh()
    groups = args.dp_size if args.enable_dp_attention else 1
    client = DPEngineClient(paths, groups, page_size=16) if groups > 1 else EngineClient(paths)
    engines = start_engines(args, paths)
    client.start(engines)
    (process,) = engines.processes
    processes: list[process_tree.Proc] = []
    try:
        await asyncio.wait_for(client.wait_ready(), 300)
        processes = [process_tree.Proc(process.pid, 0), *process_tree.descendants(process.pid)]
        assert len(processes) == 2  # the engine process (rank 0) and rank 1
        before = [await _generate(client, f"before-{i}", p) for i, p in enumerate(PROMPTS)]
        for sock in client.sockets if groups > 1 else [client.to_engine]:
            run_seeded(FUZZ(given(TO_ENGINE)(_sender(sock))))
        await client.control("stats")  # answered on each socket after every frame sent before
        with _injector(paths.from_engine) as inject:
            run_seeded(FUZZ(given(FROM_ENGINE)(_sender(inject))))
            await _read_all_injected(client, inject)
        ports = sorted({port for _, port in listening([p.pid for p in processes])})
        assert ports  # the store (rank 0) and gloo's listeners
        run_seeded(FUZZ(given(st.sampled_from(ports), st.binary(max_size=300))(_poke)))
        client.abort(list(FUZZ_RIDS))
        after = [await _generate(client, f"after-{i}", p) for i, p in enumerate(PROMPTS)]
        assert after == before
        assert client.dead is None
        assert all(alive(p.pid) for p in processes)
    finally:
        await stop_engines(client, engines, started=bool(processes))
        client.close()
        paths.cleanup(groups)
    gone = lambda: not any(alive(p.pid) for p in processes)  # noqa: E731
    await asyncio.to_thread(wait_for, gone, "every rank gone with the engine")


async def _read_all_injected(client: EngineClient, inject: zmq.Socket) -> None:
    """Inject a control reply no one asked for after the fuzz and wait until the client routes
    it: one pipe keeps its order, so every injected frame before it was read (and dropped)."""
    call_id = next(client.control_ids)
    marker = asyncio.get_running_loop().create_future()
    client.replies[call_id] = marker
    inject.send(ipc.encode(ipc.ControlReply(call_id, "marker")))
    assert await asyncio.wait_for(marker, 120) == "marker"  # hang guard
    client.replies.pop(call_id)


async def _generate(client: EngineClient, rid: str, prompt: list[int]) -> list[int]:
    request = GenerateRequest(rid=rid, input_ids=prompt, sampling=dict(SAMPLING))
    (stream,) = await client.submit([request])
    tokens: list[int] = []
    async with asyncio.timeout(120):
        async for output in stream:
            tokens.extend(output.token_ids)
    return tokens


def _sender(sock: zmq.Socket):
    def send(data: bytes) -> None:
        sock.send(data, zmq.NOBLOCK)

    return send


@contextlib.contextmanager
def _injector(address: str):
    context = zmq.Context()
    sock = context.socket(zmq.PUSH)
    sock.setsockopt(zmq.SNDHWM, 100000)
    sock.connect(address)
    try:
        yield sock
    finally:
        sock.close(linger=5000)
        context.term()


def _poke(port: int, data: bytes) -> None:
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 2) as conn:
        conn.sendall(data)
