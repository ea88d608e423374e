"""HiCache on every rank: `--tp 2` against the single-process server, through the openai SDK.

fp32 GLM with an MTP layer and a shared indexer layer, EAGLE on, prompts longer than index_topk
(8). A small device pool (12 pages of 16) holds two of the prompts: later ones evict the first
ones to the host tier; the first again comes back from the host tier (each rank loads its own
copy: a rank that skipped it would attend to stale KV for its heads), with `cached_tokens`
reported and the same tokens and logprobs as the single process, which runs the same requests
with the same flags. Then both restart on the file tier: the first prompt comes back from
storage (each rank reads its own files), and a rank is killed with a load-back in flight. DP
attention: each group has its own tiers; the same for a DeepSeek-V3.2 checkpoint (no shared
indexer layers). The process trees are checked empty after (SIGTERM to the API process alone).
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import httpx
import openai
import pytest
from server_harness import children, group_members, running_server, wait_for, wait_unhealthy
from speculative_models import make_mtp_checkpoint

PROMPTS = [[(k * 37 + 11 * i) % 290 + 5 for i in range(80)] for k in range(6)]
NEW = 6
WATCHDOG_S = 60
FLAGS = ["--dtype", "float32", "--chunked-prefill-size", "32", "--watchdog-timeout", "60",
         "--speculative-algorithm", "EAGLE", "--speculative-num-steps", "2",
         "--max-total-tokens", "192", "--context-length", "120", "--enable-hierarchical-cache",
         "--hicache-ratio", "4", "--enable-cache-report"]  # fmt: skip


@pytest.fixture(scope="module")
def glm(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("hicache_tp_glm") / "ckpt"
    return make_mtp_checkpoint(folder, "glm", seed=5, indexer_types=["full", "shared", "full"])


def storage_flags(store: Path) -> list[str]:
    extra = json.dumps({"file_path": str(store), "prefetch_threshold": 16})
    return ["--hicache-storage-backend", "file", "--hicache-storage-backend-extra-config", extra,
            "--hicache-storage-prefetch-policy", "wait_complete"]  # fmt: skip


def complete(client: openai.OpenAI, prompt: list[int]) -> tuple[str, list[float], int]:
    r = client.completions.create(model="m", prompt=prompt, max_tokens=NEW, temperature=0,
                                  logprobs=1, extra_body={"ignore_eos": True})  # fmt: skip
    cached = r.usage.prompt_tokens_details.cached_tokens
    return r.choices[0].text, list(r.choices[0].logprobs.token_logprobs), cached


def serve_sequence(model: Path, store: Path, *flags: str, restart: bool = True,
                   last: Callable = None) -> tuple:  # fmt: skip
    """The six prompts, then the first again (from the host tier); restarted on the same file
    tier, the first again (from storage). The answers and the stats after each part. The last
    server is ended by `last(server)` (a clean stop by default)."""
    runs, stats = [], []
    parts = ([*PROMPTS, PROMPTS[0]], [PROMPTS[0]])[: 1 + restart]
    for i, prompts in enumerate(parts):
        with running_server(model, *FLAGS, *storage_flags(store), *flags) as server:
            client = openai.OpenAI(base_url=server.base, api_key="x", max_retries=0, timeout=240)
            runs += [complete(client, p) for p in prompts]
            info = httpx.get(server.url + "/get_server_info", timeout=60).json()
            stats.append(info["internal_states"][0])
            (last or stop_cleanly)(server) if i == len(parts) - 1 else stop_cleanly(server)
    return runs, stats


@pytest.fixture(scope="module")
def single(glm, tmp_path_factory):
    return serve_sequence(glm, tmp_path_factory.mktemp("single_store"))


def assert_same(got: list, want: list) -> None:
    for (text, lps, cached), (want_text, want_lps, want_cached) in zip(got, want):
        assert text == want_text and cached == want_cached and len(lps) == NEW
        assert max(abs(a - b) for a, b in zip(lps, want_lps)) < 1e-4


def stop_cleanly(server) -> None:
    """SIGTERM the API process alone: it stops its engine and every rank (no SIGKILL of the
    group by the harness needed), and exits 0."""
    server.process.send_signal(signal.SIGTERM)
    assert server.process.wait(60) == 0
    # the last children (resource tracker) exit after it
    wait_for(lambda: not group_members(server.process.pid), "every process of the group gone")


def test_tp2_host_and_file_tiers_match_the_single_process(glm, single, tmp_path):
    (want, want_stats), store = single, tmp_path / "tp2"
    got, (stats, restarted) = serve_sequence(glm, store, "--tp", "2",
                                             last=kill_a_rank_mid_load_back)  # fmt: skip
    assert_same(got, want)
    assert [c for _, _, c in got] == [0] * 6 + [64, 64]  # whole pages of the 80 tokens
    assert stats["hicache_host_hit_tokens"] == want_stats[0]["hicache_host_hit_tokens"] == 64
    assert restarted["hicache_storage_hit_tokens"] == 64
    namespaces = sorted(p.name for p in store.iterdir() if p.is_dir())  # beside hicache.key
    assert len(namespaces) == 2  # one folder of pages per rank, never read by the other
    pages = [len(os.listdir(store / n)) for n in namespaces]
    assert pages[0] == pages[1] > 0


def test_dp_attention_groups_keep_their_own_tiers(glm, single, tmp_path):
    """`--tp 2 --dp 2 --enable-dp-attention`: each group has its own tiers; round-robin sends
    prompts 0, 2, 4 to group 0, which evicts prompt 0 to its host tier; prompt 0 again goes back
    to group 0 (the prefix it served) and comes from there. (A group of several ranks repeating
    its leader's moves is the `--tp 2` test's.)"""
    (want, _), store = single, tmp_path / "dpa"
    flags = ["--tp", "2", "--dp", "2", "--enable-dp-attention"]
    got, (stats,) = serve_sequence(glm, store, *flags, restart=False)
    assert_same(got, want[:7])
    groups = stats["dp_groups"]
    assert [g["hicache_host_hit_tokens"] for g in groups] == [64, 0]
    assert all(g["hicache_d2h_bytes"] > 0 for g in groups)
    assert len([p for p in store.iterdir() if p.is_dir()]) == 1  # one attention-TP rank


def test_deepseek_dp_attention_groups_keep_their_own_tiers(tmp_path_factory, tmp_path):
    """DeepSeek-V3.2 (`deepseek_v32`, MTP layer) under `--tp 2 --dp 2 --enable-dp-attention`
    with HiCache: the same tokens, logprobs and `cached_tokens` as the single process; prompt 0
    comes back from group 0's host tier."""
    folder = tmp_path_factory.mktemp("hicache_tp_deepseek") / "ckpt"
    deepseek = make_mtp_checkpoint(folder, "deepseek", seed=5)
    want, _ = serve_sequence(deepseek, tmp_path / "single", restart=False)
    flags = ["--tp", "2", "--dp", "2", "--enable-dp-attention"]
    got, (stats,) = serve_sequence(deepseek, tmp_path / "dpa", *flags, restart=False)
    assert_same(got, want)
    assert [c for _, _, c in got] == [0] * 6 + [64]
    assert [g["hicache_host_hit_tokens"] for g in stats["dp_groups"]] == [64, 0]


def kill_a_rank_mid_load_back(server) -> None:
    """kill -9 of the follower while a request whose prefix loads back from the storage tier is
    in flight (the follower is SIGSTOPped first, so the group's rounds stall on it: in the idle
    heartbeat or in that request's step, whichever the leader reached; which one is not
    observable from outside): /health names the stopped follower and the request is still
    unanswered; after the kill the request fails (within the watchdog time), /health turns 503,
    every process of the engine is gone and no shared-memory file is left."""
    shm_before = set(os.listdir("/dev/shm"))
    client = openai.OpenAI(base_url=server.base, api_key="x", max_retries=0, timeout=120)
    engine = httpx.get(server.url + "/get_server_info", timeout=30).json()["engine_pid"]
    (follower,) = children(engine)
    os.kill(follower, signal.SIGSTOP)
    with ThreadPoolExecutor(1) as pool:
        answer = pool.submit(complete, client, PROMPTS[1])  # stored by the first server
        assert "no heartbeat from rank 1" in wait_unhealthy(server)  # the follower is stopped
        assert not answer.done()  # ... and the group's rounds with it
        os.kill(follower, signal.SIGKILL)
        with pytest.raises(openai.APIError):
            answer.result(timeout=WATCHDOG_S + 120)  # hang guard
    assert httpx.get(server.url + "/health", timeout=10).status_code == 503
    gone = lambda: not any(os.path.exists(f"/proc/{pid}") for pid in (engine, follower))  # noqa: E731
    alive = lambda: [p for p in (engine, follower) if os.path.exists(f"/proc/{p}")]  # noqa: E731
    wait_for(gone, lambda: f"the engine and its follower gone; alive: {alive()}")
    left = {f for f in set(os.listdir("/dev/shm")) - shm_before if f.startswith("dsaserve")}
    assert not left


def test_a_follower_replays_the_leaders_moves_on_its_own_tiers(tmp_path):
    """Unit: the journal of every kind of move, replayed on a follower whose device pool started
    equal, leaves its device pool, host tier and storage pages equal to the leader's; its files
    are keyed by its own identity (none of the leader's keys)."""
    import torch

    from dsaserve.engine.kvcache.codec import PageCodec
    from dsaserve.engine.kvcache.moves import HostKVPool, TierMoves
    from dsaserve.engine.kvcache.storage import FileBackend, StorageTier

    page, pages = 4, 8

    def rank(identity: str, kv: torch.Tensor, index: torch.Tensor, **kw) -> TierMoves:
        pool = SimpleNamespace(kv_cache=kv.clone(), index_cache=index.clone(), page_size=page)
        codec = PageCodec(identity, (3, page, 5), (2, page, 6), torch.float32, b"k" * 32)
        backend = FileBackend(str(tmp_path), identity[:16], 1 << 30)
        return TierMoves(pool, HostKVPool(pool, 6), StorageTier(backend, codec), **kw)

    kv, index = torch.randn(3, pages * page, 5), torch.randn(2, pages * page, 6)
    leader = rank("a" * 64, kv, index, record=True)
    follower = rank("b" * 64, kv, index, leader_keys=True)
    keys = leader.storage.codec.page_keys(list(range(3 * page)), page)
    leader.d2h([1, 2, 3], [0, 4, 5])
    leader.store([0, 4, 5], keys)
    leader.pool.kv_cache[:, :page] = 7.0  # a forward overwrote device page 0 ...
    follower.pool.kv_cache[:, :page] = 7.0  # ... on every rank
    leader.h2d([4, 5], [0, 6])
    leader.storage.drain()
    read = [leader.storage.read(k) for k in keys[:2]]
    leader.load([2, 7], read, keys[:2])
    follower.replay(leader.take_journal())
    follower.storage.drain()
    assert leader.take_journal() is None
    for a, b in [(leader.pool, follower.pool), (leader.host, follower.host)]:
        assert torch.equal(a.kv_cache, b.kv_cache) and torch.equal(a.index_cache, b.index_cache)
    own = sorted(os.listdir(tmp_path / ("b" * 16)))
    assert len(own) == 3 and not set(own) & {f"{k}.kv" for k in keys}
