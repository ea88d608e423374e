"""Disaggregation parts without servers: segments that move exactly a room's bytes (checked by
the per-room checksums, which catch one flipped byte in the MTP layer), the aux record, the
bootstrap server's answers, and the router's fields on a request."""

from __future__ import annotations

import asyncio
import ctypes
import socket
import threading
import types

import httpx
import pytest
import torch
import zmq
from server_harness import wait_for

from dsaserve.args import ServerArgs
from dsaserve.disaggregation import aux_record, bootstrap, kv_regions
from dsaserve.disaggregation.directory import PrefillDirectory
from dsaserve.disaggregation.protocol import KVPoll, Status, TransferInfo, parse_to_prefill
from dsaserve.disaggregation.request_fields import attach_bootstrap
from dsaserve.engine.kvcache.pool import KVPool
from dsaserve.engine.messages import Bootstrap, GenerateRequest, TokenLogprob
from dsaserve.runtime import ipc
from dsaserve.server.dp_controller import DPEngineClient
from dsaserve.server.openai.protocol import GenerateRequestIn
from dsaserve.web.errors import APIError

CONFIG = types.SimpleNamespace(num_hidden_layers=2, kv_entry_dim=12, index_head_dim=8)


def _pool(num_pages: int) -> KVPool:
    return KVPool(CONFIG, num_pages, 4, 3, True, torch.float32)  # 2 layers + MTP, 3 indexer


def _copy(segments: list[tuple[int, int, int]]) -> None:
    """What a transfer engine does with segments, in one process."""
    for src, dst, size in segments:
        ctypes.memmove(dst, src, size)


def test_segments_move_every_layer_indexer_and_mtp_entry() -> None:
    prefill, decode = _pool(8), _pool(16)  # different pool sizes: different layer strides
    torch.manual_seed(0)
    prefill.kv_cache.normal_()
    prefill.index_cache.normal_()
    src_pages, dst_pages, prompt_len = [5, 6, 2], [0, 1, 9], 10  # runs: (5,6)->(0,1), 2->9
    src_aux, dst_aux = aux_record.buffer(1), aux_record.buffer(4)
    mine = kv_regions.describe(prefill, True, src_aux)
    theirs = kv_regions.describe(decode, True, dst_aux)
    assert kv_regions.mismatch(mine, theirs) is None
    segments = kv_regions.kv_segments(mine, theirs, src_pages, dst_pages)
    assert len(segments) == (3 + 3) * 2  # per layer of both caches, two runs
    _copy(segments)
    sent = kv_regions.checksums(prefill, src_pages, prompt_len)
    assert kv_regions.checksums(decode, dst_pages, prompt_len) == sent
    assert len(sent["kv"]) == 3 and len(sent["index"]) == 3
    decode.kv_cache[2, dst_pages[0] * 4 + 1, 3] += 1.0  # one value in the MTP layer
    got = kv_regions.checksums(decode, dst_pages, prompt_len)
    assert [a == b for a, b in zip(got["kv"], sent["kv"])] == [True, True, False]
    assert got["index"] == sent["index"]


def test_layout_mismatch_names_the_mtp_layer() -> None:
    with_mtp = kv_regions.describe(_pool(4), True, aux_record.buffer(1))
    without = kv_regions.describe(KVPool(CONFIG, 4, 4, 2, False, torch.float32), False,
                                 aux_record.buffer(1))  # fmt: skip
    assert "--speculative-algorithm" in kv_regions.mismatch(with_mtp, without)


def test_aux_record_round_trip() -> None:
    buf = aux_record.buffer(3)
    logprob = TokenLogprob(42, -0.25, [(42, -0.25), (7, -1.5)])
    aux_record.pack(buf, 2, 42, logprob)
    assert aux_record.unpack(buf, 2, 100) == (42, logprob)
    aux_record.pack(buf, 1, 9, None)
    assert aux_record.unpack(buf, 1, 100) == (9, None)


def test_frames_round_trip() -> None:
    info = TransferInfo(2**63 - 1, "tcp://127.0.0.1:5", "agent", [3, 1, 4], 7)
    assert parse_to_prefill(info.frames()) == info
    status = Status(5, KVPoll.Success, 0, {"checksums": {"kv": ["ab"]}})
    assert Status.parse(status.frames()) == status


def test_bootstrap_server_routes() -> None:
    server = bootstrap.BootstrapServer("127.0.0.1", 0, None, 10.0)
    address = f"127.0.0.1:{server.port}"
    try:
        assert bootstrap.healthy(address)
        url = f"http://{address}/route?prefill_dp_rank=-1&prefill_cp_rank=-1&target_tp_rank=-1"
        assert httpx.get(url + "&target_pp_rank=-1").status_code == 503  # nothing registered
        assert httpx.get(url).status_code == 400  # a rank missing
        rank = {k: 0 for k in ("attn_tp_rank", "attn_cp_rank", "attn_dp_rank", "pp_rank",
                               "system_dp_rank")}  # fmt: skip
        sizes = {k: 1 for k in ("attn_tp_size", "attn_cp_size", "attn_dp_size", "pp_size",
                                "system_dp_size")}  # fmt: skip
        bootstrap.register_rank(address, {**rank, **sizes, "rank_ip": "127.0.0.1",
                                          "rank_port": 1234, "page_size": 64,
                                          "kv_cache_dtype": "bf16"}, None)  # fmt: skip
        info = bootstrap.query_route(address, (-1, -1, -1, -1), None)
        assert (info["attn_tp_size"], info["page_size"]) == (1, 64)
        assert bootstrap.query_route(address, (0, 0, 0, 0), None) == {"rank_ip": "127.0.0.1",
                                                                "rank_port": 1234}  # fmt: skip
        with pytest.raises(RuntimeError, match="404"):
            bootstrap.query_route(address, (0, 0, 1, 0), None)
    finally:
        server.close()


def _rank(group: int, groups: int, port: int) -> dict:
    """A prefill group leader's registration (attn_dp_rank `group` of `groups`)."""
    return {"attn_tp_size": 1, "attn_tp_rank": 0, "attn_cp_size": 1, "attn_cp_rank": 0,
            "attn_dp_size": groups, "attn_dp_rank": group, "pp_size": 1, "pp_rank": 0,
            "rank_ip": "127.0.0.1", "rank_port": port, "page_size": 16,
            "kv_cache_dtype": "bf16"}  # fmt: skip


def test_a_dp_attention_prefill_registers_every_group_and_the_decode_resolves_each(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Group 1 registers while group 0's bootstrap server is not listening yet (it waits); the
    layout answers 503 until both groups registered, then `dp_size` 2; the decode's directory
    resolves both groups' endpoints and sends room r to group r % 2."""
    with socket.socket() as holder:  # bound, not listening: the port is ours, connects refused
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # the server binds it too
        holder.bind(("127.0.0.1", 0))
        _registers_while_the_server_starts(f"127.0.0.1:{holder.getsockname()[1]}", monkeypatch)


def _registers_while_the_server_starts(address: str, monkeypatch: pytest.MonkeyPatch) -> None:
    refused, request = threading.Event(), bootstrap._request

    def counted(*args, **kwargs):  # the real request; says when one found nobody listening
        try:
            return request(*args, **kwargs)
        except OSError:
            refused.set()
            raise

    monkeypatch.setattr(bootstrap, "_request", counted)
    with pytest.raises(OSError):  # without waiting: nobody listens yet
        bootstrap.register_rank(address, _rank(1, 2, 2001), None)
    refused.clear()
    registered: list = []
    waiting = threading.Thread(target=lambda: registered.append(
        bootstrap.register_rank(address, _rank(1, 2, 2001), None, wait=120.0)))  # fmt: skip
    waiting.start()
    server = directory = None
    try:
        assert refused.wait(60), "group 1 tried before the server listened"  # hang guard
        server = bootstrap.BootstrapServer("127.0.0.1", int(address.split(":")[1]), None, 10.0)
        waiting.join(120)  # hang guard
        assert len(registered) == 1 and registered[0], "group 1 registered once it listened"
        with pytest.raises(RuntimeError, match="503"):  # group 0 not registered yet
            bootstrap.query_route(address, (-1, -1, -1, -1), None)
        bootstrap.register_rank(address, _rank(0, 2, 2000), None)
        info = bootstrap.query_route(address, (-1, -1, -1, -1), None)
        assert info["dp_size"] == 2 and info["follow_bootstrap_room"]
        directory = PrefillDirectory(0.2, None)
        directory.want(address)
        wait_for(lambda: directory.get(address).endpoints, "the directory's prefill endpoints")
        prefill = directory.get(address)
        assert prefill.endpoints == ("tcp://127.0.0.1:2000", "tcp://127.0.0.1:2001")
        assert [prefill.endpoint(room) for room in (4, 7, 2**63 - 1)] == [
            "tcp://127.0.0.1:2000", "tcp://127.0.0.1:2001", "tcp://127.0.0.1:2001"]  # fmt: skip
    finally:
        waiting.join(120)  # hang guard
        if directory is not None:
            directory.close()
        if server is not None:
            server.close()


def test_a_dp_attention_prefill_controller_sends_each_room_to_its_group() -> None:
    """`follow_room`: room r goes to group r % 2, a batch split across groups in request
    order; without it the batch stays together and the policy decides."""
    assert asyncio.run(_dispatched(follow_room=True)) == [[["4"]], [["7", "9"]]]
    assert asyncio.run(_dispatched(follow_room=False)) == [[["4", "7", "9"]], []]


async def _dispatched(follow_room: bool) -> list[list[list[str]]]:
    """Each group's messages (each a list of rids), read until all three requests arrived."""
    paths = ipc.IpcPaths.fresh()
    client = DPEngineClient(paths, 2, follow_room=follow_room)
    context = zmq.Context()
    inboxes = []
    try:
        for group in range(2):
            inboxes.append(context.socket(zmq.PULL))
            inboxes[-1].connect(paths.for_group(group).to_engine)
            assert client.sockets[group].poll(60_000, zmq.POLLOUT)  # connected; hang guard
        requests = _requests(3)
        for request, room in zip(requests, (4, 7, 9)):
            request.rid = str(room)
            request.bootstrap = Bootstrap(host="127.0.0.1", port=1, room=room)
        streams = await client.submit(requests)
        assert [stream.rid for stream in streams] == ["4", "7", "9"]
        got: list[list[list[str]]] = [[] for _ in inboxes]

        def all_arrived() -> bool:  # reads what each group's socket has, True once all came
            for inbox, messages in zip(inboxes, got):
                if inbox.poll(50):
                    messages.append([r.rid for r in ipc.decode_to_engine(inbox.recv()).requests])
            return sum(len(m) for g in got for m in g) >= len(requests)

        wait_for(all_arrived, "every request at its group's socket", poll=0)
        for stream in streams:
            stream.end(abort=False)
        return got
    finally:
        for inbox in inboxes:
            inbox.close(linger=0)
        context.term()
        client.close()
        paths.cleanup(2)


def _requests(n: int) -> list[GenerateRequest]:
    return [GenerateRequest(rid=str(i), input_ids=[1], sampling={}) for i in range(n)]


def test_router_fields_on_requests() -> None:
    decode = ServerArgs(disaggregation_mode="decode", disaggregation_bootstrap_port=9100)
    body = GenerateRequestIn.model_validate({
        "text": "hi", "bootstrap_host": "10.0.0.2", "bootstrap_port": None,
        "bootstrap_room": 2**63 - 1,
    })  # fmt: skip
    requests = _requests(1)
    attach_bootstrap(decode, body, requests)
    assert requests[0].bootstrap.port == 9100 and requests[0].bootstrap.room == 2**63 - 1
    batch = GenerateRequestIn.model_validate({
        "text": "hi", "bootstrap_host": ["a", "b"], "bootstrap_port": [1, 2],
        "bootstrap_room": [3, 4],
    })  # fmt: skip
    requests = _requests(2)
    attach_bootstrap(decode, batch, requests)
    assert [(r.bootstrap.host, r.bootstrap.port, r.bootstrap.room) for r in requests] == [
        ("a", 1, 3), ("b", 2, 4)]  # fmt: skip
    with pytest.raises(APIError, match="bootstrap_room"):
        attach_bootstrap(decode, GenerateRequestIn(text="hi"), _requests(1))
    regular = ServerArgs()
    attach_bootstrap(regular, body, requests := _requests(1))  # accepted, ignored
    assert requests[0].bootstrap is None
    with pytest.raises(ValueError):
        GenerateRequestIn.model_validate({"text": "x", "bootstrap_room": 2**63})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8])
def test_kv_share_message_copies_exactly_the_slots(dtype):
    """A `--tp N` decode's first rank copies the entries it received to its other ranks: every
    layer of both pool tensors at those slots, bit for bit (FP8 pools are bytes), nothing else."""
    from dsaserve.engine.ranks.payload import pool_entries, write_entries

    def pool(seed: int, width: int) -> torch.Tensor:
        t = torch.randn(3, 48, width, generator=torch.Generator().manual_seed(seed)) * 50
        return t.to(dtype)

    kv, index = pool(0, 5), pool(1, 7)
    slots = torch.tensor([8, 9, 10, 11, 32, 33, 34, 35])
    other_kv, other_index = torch.zeros_like(kv), torch.zeros_like(index)
    write_entries(other_kv, other_index, pool_entries(kv, index, slots))
    for mine, theirs in ((kv, other_kv), (index, other_index)):
        assert torch.equal(theirs[:, slots], mine[:, slots])
        rest = torch.ones(48, dtype=torch.bool)
        rest[slots] = False
        assert not theirs[:, rest].any()
