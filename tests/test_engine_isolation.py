"""Issue 12, inside the processes: the engine never trusts its input (a request that fails in
`add_request` or in its own step ends with an error for that request alone), the engine loop
survives anything a message carries, and the API's engine client leaves no ghost rid behind."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any

import pytest
import zmq
from tiny_models import make_checkpoint

from dsaserve import SamplingParams
from dsaserve.args import ServerArgs
from dsaserve.engine.engine import Engine
from dsaserve.engine.messages import GenerateRequest
from dsaserve.runtime import ipc
from dsaserve.runtime.engine_process import EngineLoop
from dsaserve.server.engine_client import EngineClient
from dsaserve.web.errors import APIError

GREEDY = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
BAD_SAMPLING = [
    {"stop": 5}, {"stop": [1]}, {"stop_token_ids": 5}, {"stop_token_ids": "x"},
    {"stop_token_ids": [10**6]}, {"top_k": 1.5}, {"seed": 1.5}, {"seed": 2**70},
    {"logprobs": True}, {"skip_special_tokens": "x"}, {"grammar_after_token_id": 999999},
    {"grammar_after_token_id": -3}, {"grammar_after_token_id": "x"}, {"regex": 5},
    {"json_schema": {"type": "object"}}, {"temperature": float("inf")},
    {"no_such_field": 1},
]  # fmt: skip


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    path = make_checkpoint(tmp_path_factory.mktemp("isolation") / "ckpt", "glm", seed=5)
    return Engine(ServerArgs(model_path=str(path), max_total_tokens=1024, page_size=8))


def request(rid: str, ids: list[int], **sampling: Any) -> GenerateRequest:
    fields = dataclasses.asdict(GREEDY) | sampling
    return GenerateRequest(rid=rid, input_ids=ids, sampling=fields)


def run_all(engine: Engine) -> dict[str, Any]:
    finals = {}
    while engine.has_work():
        for output in engine.step():
            if output.finished:
                finals[output.rid] = output
    return finals


@pytest.mark.parametrize("bad", BAD_SAMPLING, ids=[str(b) for b in BAD_SAMPLING])
def test_add_request_refuses_bad_sampling_and_leaves_nothing(engine: Engine, bad: dict):
    with pytest.raises(ValueError):
        engine.add_request(request("bad", [1, 2, 3], **bad))
    assert "bad" not in engine.reqs and not engine.has_work()


def test_a_failed_step_ends_its_batch_only(engine: Engine, monkeypatch: pytest.MonkeyPatch):
    engine.add_request(request("ref", [5, 6, 7, 8]))
    reference = run_all(engine)["ref"]
    free = engine.pool.pages.num_free + engine.cache.evictable_pages
    engine.add_request(request("doomed", [9, 10, 11]))
    real_forward = engine.runner.forward

    def broken(*args: Any, **kwargs: Any) -> Any:
        monkeypatch.setattr(engine.runner, "forward", real_forward)  # fails once
        raise RuntimeError("simulated kernel failure")

    monkeypatch.setattr(engine.runner, "forward", broken)
    finals = run_all(engine)
    reason = finals["doomed"].finish_reason
    assert reason["type"] == "error" and reason["status"] == 500, reason
    assert not engine.reqs and engine.stats()["kv_used_tokens"] == 0
    assert engine.pool.pages.num_free + engine.cache.evictable_pages == free
    engine.add_request(request("again", [5, 6, 7, 8]))  # the engine still serves, exactly
    assert run_all(engine)["again"].token_ids == reference.token_ids


class _Outbox:
    def __init__(self) -> None:
        self.messages: list = []

    def send(self, data: bytes) -> None:
        self.messages.append(ipc.decode_from_engine(data))


class _FailingEngine:
    """add_request raises what a buggy engine might; the loop must answer, not die."""

    def __init__(self, error: Exception) -> None:
        self.error = error

    def add_request(self, request: GenerateRequest) -> None:
        raise self.error

    def abort(self, rid: str) -> None:
        raise RuntimeError("abort bug")

    def stats(self) -> dict:
        return {"num_waiting": 0}

    def has_work(self) -> bool:
        return False


@pytest.mark.parametrize("error,status", [(ValueError("bad"), 400), (KeyError("bug"), 500)])
def test_engine_loop_rejects_instead_of_dying(error: Exception, status: int, caplog):
    outbox = _Outbox()
    loop = EngineLoop(_FailingEngine(error), ServerArgs(), None, outbox, 0)
    loop._handle(ipc.Submit([request("a", [1]), request("b", [2])]))
    loop._handle(ipc.Abort(["a"]))
    loop._refuse_undecodable(ipc.encode(ipc.Submit([request("c", [1])]))[:-3], ValueError("x"))
    loop._refuse_undecodable(b"\xc1garbage", ValueError("x"))
    assert loop.frames.counts == {"undecodable": 2}  # counted; logged once, not per frame
    assert caplog.text.count("dropped a frame from the API process (undecodable)") == 1
    loop._flush()
    rejected = [m for m in outbox.messages if isinstance(m, ipc.Rejected)]
    assert rejected[0].rids == ["a", "b"] and rejected[0].status == status
    assert isinstance(outbox.messages[0], ipc.Stats)  # stats go first


async def submit_once_connected(client: EngineClient, req: GenerateRequest) -> list:
    """Submit, retrying while the engine's socket has no peer yet (503: zmq connects in the
    background), each refusal leaving no rid behind."""
    deadline = time.monotonic() + 60  # hang guard
    while True:
        try:
            return await client.submit([req])
        except APIError as e:
            assert e.status == 503 and client.in_flight_rids() == []
            assert time.monotonic() < deadline, "the peer never connected"
            await asyncio.sleep(0.05)


def test_engine_client_leaves_no_ghost_rids():
    async def scenario() -> None:
        paths = ipc.IpcPaths.fresh()
        client = EngineClient(paths)
        peer = zmq.Context().socket(zmq.PULL)
        try:
            with pytest.raises(APIError) as refused:  # msgspec cannot carry 2^70
                await client.submit([request("big", [1], seed=2**70)])
            assert refused.value.status == 400 and client.in_flight_rids() == []
            with pytest.raises(APIError) as unsent:  # no engine to send to: the send fails
                await client.submit([request("unsent", [1])])
            assert unsent.value.status == 503 and client.in_flight_rids() == []
            peer.connect(paths.to_engine)
            streams = await submit_once_connected(client, request("unsent", [1]))  # rid free
            assert client.in_flight_rids() == ["unsent"]
            del streams  # never read (an error between submit and the first read)
            assert client.in_flight_rids() == []
            assert isinstance(ipc.decode_to_engine(peer.recv()), ipc.Submit)
            assert ipc.decode_to_engine(peer.recv()) == ipc.Abort(["unsent"])  # KV freed
            streams = await client.submit([request("closed", [1])])
            await streams[0].aclose()
            assert client.in_flight_rids() == []
        finally:
            peer.close(linger=0)
            client.close()
            paths.cleanup()

    asyncio.run(scenario())
