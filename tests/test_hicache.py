"""HiCache (host tier): pages move bit-exactly in every layer, indexer layer and the MTP layer,
and outputs with the hierarchy on equal outputs with it off under a device pool too small to
keep any shared prefix between requests.

Exactness, measured: greedy tokens equal the hierarchy-off run (which recomputes the evicted
prefix); per-step logprobs are bit-identical to a run whose device pool is large enough to keep
every prefix (the same cached KV bytes, served from the device), and within 1e-6 of the
recompute (a prefix computed in one pass vs two differs in fp32 rounding, with or without HiCache).
"""

from __future__ import annotations

import pytest
import torch
from speculative_models import make_mtp_checkpoint

from dsaserve import LLM, SamplingParams
from dsaserve.engine.kvcache.hicache import HiRadixCache
from dsaserve.engine.kvcache.moves import page_slots

PAGE = 8
POOL = 96  # 12 pages: one 64-token prefix + its suffix and output, never two prefixes
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=2)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return str(make_mtp_checkpoint(tmp_path_factory.mktemp("hicache") / "ckpt", "glm", seed=4))


def _family(seed: int, n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(0, 380, (64,), generator=g).tolist()
    return [prefix + torch.randint(0, 380, (3 + i,), generator=g).tolist() for i in range(n)]


A, B = _family(1, 4), _family(2, 4)
ALTERNATING = [A[0], B[0], A[1], B[1], A[2], B[2]]  # each prefix evicted before its next use
TWICE = [A[0], A[1], B[0], B[1], A[2], B[2], A[3]]  # write_through_selective backs up on hit 2


def run(checkpoint: str, prompts: list[list[int]], **kw) -> tuple[LLM, list]:
    llm = LLM(checkpoint, **{"page_size": PAGE, "max_total_tokens": POOL, **kw})
    return llm, [llm.generate([p], GREEDY, use_tqdm=False)[0] for p in prompts]


def result(outs) -> list:
    return [(o.token_ids, [(lp.token_id, lp.logprob, lp.top) for lp in o.logprobs]) for o in outs]


def assert_close_logprobs(outs, others, atol: float = 1e-5) -> None:
    for out, other in zip(outs, others):
        for lp, lp_other in zip(out.logprobs, other.logprobs):
            assert lp.token_id == lp_other.token_id
            assert abs(lp.logprob - lp_other.logprob) <= atol


def check_tree(cache: HiRadixCache) -> None:
    """Accounting invariants: every page is free or in exactly one node, per tier."""
    nodes = list(cache._nodes())
    device = [p for n in nodes for p in n.pages]
    host = [p for n in nodes for p in n.host_pages or []]
    assert len(set(device)) == len(device) and len(set(host)) == len(host)
    assert len(device) + cache.pool.num_free == cache.pool.num_pages
    assert len(host) + cache.host.pages.num_free == cache.host.pages.num_pages
    assert cache.cached_pages == len(device)
    assert cache.evictable_pages == sum(len(n.pages) for n in nodes if n.lock_ref == 0)
    for n in nodes:
        assert n.pages or n.host_pages is not None, "a node must live on some tier"
        if n.pages and n.parent is not cache.root:
            assert n.parent.pages, "a device node's parent is on the device"


@pytest.mark.parametrize("spec", [False, True], ids=["plain", "eagle"])
@pytest.mark.parametrize("policy", ["write_through", "write_through_selective", "write_back"])
def test_outputs_identical_with_hierarchy_on_and_off(checkpoint, policy, spec):
    prompts = TWICE if policy == "write_through_selective" else ALTERNATING
    extra = {"speculative_algorithm": "EAGLE"} if spec else {}
    _, off = run(checkpoint, prompts, **extra)
    _, warm = run(checkpoint, prompts, max_total_tokens=4096, **extra)  # off, nothing evicted
    llm, on = run(checkpoint, prompts, enable_hierarchical_cache=True,
                  hicache_write_policy=policy, **extra)  # fmt: skip
    assert [o.token_ids for o in on] == [o.token_ids for o in off]
    assert result(on) == result(warm)
    assert_close_logprobs(on, off)
    assert [o.cached_tokens for o in on] == [o.cached_tokens for o in warm]
    stats = llm.engine.stats()
    reused = [o.cached_tokens for o in on][-2:]  # the last use of each prefix: evicted before
    assert reused == [64, 64], reused
    assert stats["hicache_host_hit_tokens"] >= 128
    assert [o.cached_tokens for o in off][-2:] == [0, 0]  # the small pool really evicts them
    check_tree(llm.engine.cache)


def test_chunked_prefill_and_retraction_with_hierarchy(checkpoint):
    prompts = ALTERNATING + TWICE
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    alone = LLM(checkpoint, page_size=PAGE, max_total_tokens=4096, disable_radix_cache=True)
    expected = [alone.generate([p], params, use_tqdm=False)[0].token_ids for p in prompts]
    llm = LLM(checkpoint, page_size=PAGE, max_total_tokens=160, chunked_prefill_size=16,
              enable_hierarchical_cache=True, speculative_algorithm="EAGLE")  # fmt: skip
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in outs] == expected
    assert llm.engine.scheduler.num_retractions > 0
    assert llm.engine.stats()["kv_used_tokens"] == 0
    check_tree(llm.engine.cache)
    again = llm.generate(prompts[:3], params, use_tqdm=False)  # served from device/host now
    assert [o.token_ids for o in again] == expected[:3] and all(o.cached_tokens for o in again)
    check_tree(llm.engine.cache)


def _round_trip_mismatches(checkpoint: str) -> list[str]:
    """Fill KV for a prompt, demote it to host, scrub the device pool, load it back: the names of
    the tensors (kv / index) whose bytes differ from the original anywhere."""
    llm = LLM(checkpoint, page_size=PAGE, max_total_tokens=POOL, enable_hierarchical_cache=True,
              speculative_algorithm="EAGLE", hicache_write_policy="write_back")  # fmt: skip
    prompt = A[0]
    llm.generate([prompt], GREEDY, use_tqdm=False)
    cache, pool = llm.engine.cache, llm.engine.pool
    pages, _ = cache.match_prefix(prompt)
    slots = page_slots(pages, PAGE)
    kv, index = pool.kv_cache[:, slots].clone(), pool.index_cache[:, slots].clone()
    cfg = llm.engine.model_config
    assert kv.shape[0] == cfg.num_hidden_layers + 1  # the MTP layer's entries travel too
    assert index.shape[0] >= cfg.num_hidden_layers + 1 and index.abs().amax(-1).gt(0).all()
    assert cache.evict(pool.pages.num_pages) >= len(pages)
    assert cache.cached_pages == 0
    pool.kv_cache.zero_()
    pool.index_cache.zero_()
    loaded, _ = cache.match_prefix(prompt)
    assert len(loaded) == len(pages)
    back = page_slots(loaded, PAGE)
    names = [("kv", kv, pool.kv_cache), ("index", index, pool.index_cache)]
    check_tree(cache)
    return [name for name, orig, now in names if not torch.equal(now[:, back], orig)]


def test_round_trip_device_host_device_is_bit_exact(checkpoint):
    assert _round_trip_mismatches(checkpoint) == []


def test_round_trip_catches_indexer_keys_left_behind(checkpoint, monkeypatch):
    """The check above fails if a move forgets the indexer keys (the SGLang DSA bug class)."""

    def latent_only(self, device_pages, host_pages):
        ds, hs = page_slots(device_pages, self.page_size), page_slots(host_pages, self.page_size)
        self.host.kv_cache[:, hs] = self.kv_pool.kv_cache[:, ds]

    monkeypatch.setattr(HiRadixCache, "_copy_d2h", latent_only)
    assert _round_trip_mismatches(checkpoint) == ["index"]


def test_flush_cache_clears_device_and_host(checkpoint):
    llm, _ = run(checkpoint, ALTERNATING[:3], enable_hierarchical_cache=True)
    assert llm.engine.stats()["hicache_host_used_tokens"] > 0
    assert llm.engine.flush_cache()
    stats = llm.engine.stats()
    assert stats["hicache_host_used_tokens"] == 0 and stats["kv_cached_tokens"] == 0
    assert llm.generate([A[1]], GREEDY, use_tqdm=False)[0].cached_tokens == 0


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--hicache-storage-backend", "file"], "needs --enable-hierarchical-cache"),
        (["--enable-hierarchical-cache", "--hicache-storage-backend-extra-config", "[1]"],
         "must be a JSON object"),
        (["--enable-hierarchical-cache", "--hicache-ratio", "0"], "--hicache-ratio must be > 0"),
    ],
)  # fmt: skip
def test_bad_hicache_flags_are_refused(flags, message):
    from dsaserve.args import ArgsError, ServerArgs

    with pytest.raises(ArgsError, match=message):
        ServerArgs.from_cli(flags)


def test_hierarchy_needs_the_radix_cache(checkpoint):
    from dsaserve.args import ArgsError

    with pytest.raises(ArgsError, match="needs the radix cache"):
        LLM(checkpoint, enable_hierarchical_cache=True, disable_radix_cache=True)


@pytest.mark.parametrize(
    "policy, host_after",
    [("write_through", [72, 80, 152]), ("write_through_selective", [0, 64, 64]),
     ("write_back", [0, 0, 80])],
)  # fmt: skip
def test_write_policies_copy_to_host_when_sglang_does(checkpoint, policy, host_after):
    """Host tokens after: the first request (its 9 pages inserted = hit 1), a second sharing its
    first 8 pages (hit 2 for those; one new page), then a request of another prefix that evicts
    the first two from the device. write_through copies every insert; selective copies the 8
    shared pages on their second hit only; write_back copies what the eviction demotes."""
    llm = LLM(checkpoint, page_size=PAGE, max_total_tokens=POOL, enable_hierarchical_cache=True,
              hicache_write_policy=policy)  # fmt: skip
    seen = []
    for prompt in (A[0], A[1], B[0]):
        llm.generate([prompt], GREEDY, use_tqdm=False)
        seen.append(llm.engine.stats()["hicache_host_used_tokens"])
    assert seen == host_after
