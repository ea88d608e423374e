"""Every engine path gives the tokens of one request alone; sampling options behave."""

from __future__ import annotations

import pytest
import torch
from tiny_models import make_checkpoint

from dsaserve import LLM, SamplingParams
from dsaserve.engine.messages import GenerateRequest

GREEDY = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return str(make_checkpoint(tmp_path_factory.mktemp("paths") / "ckpt", "glm", seed=3))


@pytest.fixture(scope="module")
def prompts():
    generator = torch.Generator().manual_seed(7)
    lengths = [3, 9, 17, 40, 64, 5, 33, 12] * 4
    return [torch.randint(0, 380, (n,), generator=generator).tolist() for n in lengths]


@pytest.fixture(scope="module")
def alone(checkpoint, prompts):
    """Each prompt generated on its own: the baseline every path must reproduce."""
    llm = LLM(checkpoint, max_total_tokens=4096, disable_radix_cache=True)
    return [llm.generate([p], GREEDY, use_tqdm=False)[0].token_ids for p in prompts]


@pytest.mark.parametrize(
    "engine_args",
    [
        {"chunked_prefill_size": 3},
        {"page_size": 1},
        {"page_size": 16},
        {"max_running_requests": 1},
        {"max_total_tokens": 192, "page_size": 8},  # forces retraction
    ],
    ids=["chunk3", "page1", "page16", "one-at-a-time", "tiny-kv"],
)
def test_batched_paths_match_alone(checkpoint, prompts, alone, engine_args):
    llm = LLM(checkpoint, **{"max_total_tokens": 8192, **engine_args})
    outputs = llm.generate(prompts[:12], GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outputs] == alone[:12]
    if "max_total_tokens" in engine_args and engine_args["max_total_tokens"] < 1000:
        assert llm.engine.scheduler.num_retractions > 0
    assert llm.engine.stats()["kv_used_tokens"] == 0


@pytest.mark.parametrize("batch", [1, 2, 7, 32])
def test_batch_sizes_match_alone(checkpoint, prompts, alone, batch):
    llm = LLM(checkpoint, max_total_tokens=8192, page_size=4)
    outputs = llm.generate(prompts[:batch], GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outputs] == alone[:batch]


def test_radix_cache_hit_reuses_prefix(checkpoint, prompts):
    llm = LLM(checkpoint, max_total_tokens=4096, page_size=4)
    shared = prompts[4] + prompts[3]  # 104 tokens
    first = llm.generate([shared + [1, 2]], GREEDY, use_tqdm=False)[0]
    second = llm.generate([shared + [3, 4, 5]], GREEDY, use_tqdm=False)[0]
    fresh = LLM(checkpoint, max_total_tokens=4096, disable_radix_cache=True)
    expected = fresh.generate([shared + [3, 4, 5]], GREEDY, use_tqdm=False)[0]
    assert first.cached_tokens == 0
    assert second.cached_tokens == 104
    assert second.token_ids == expected.token_ids
    assert fresh.generate([shared], GREEDY, use_tqdm=False)[0].cached_tokens == 0


def test_abort_frees_everything(checkpoint, prompts):
    llm = LLM(checkpoint, max_total_tokens=2048, page_size=4, disable_radix_cache=True)
    engine = llm.engine
    for i, prompt in enumerate(prompts[:6]):
        engine.add_request(GenerateRequest(rid=f"r{i}", input_ids=prompt, sampling={}))
    engine.step()
    engine.step()
    assert engine.stats()["kv_used_tokens"] > 0
    for i in range(6):
        out = engine.abort(f"r{i}")
        assert out.finished and out.finish_reason["type"] == "abort"
    assert not engine.has_work()
    assert engine.stats()["kv_free_pages"] == engine.pool.pages.num_pages


def test_seed_reproducible_and_n(checkpoint, prompts):
    llm = LLM(checkpoint, max_total_tokens=4096)
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=11, n=3, ignore_eos=True)
    a = llm.generate([prompts[1]], params, use_tqdm=False)[0]
    b = llm.generate([prompts[2], prompts[1]], params, use_tqdm=False)[1]
    assert [s.token_ids for s in a.samples] == [s.token_ids for s in b.samples]
    assert len({tuple(s.token_ids) for s in a.samples}) > 1


def test_stops_lengths_and_logprobs(checkpoint, prompts):
    llm = LLM(checkpoint, max_total_tokens=4096)
    base = llm.generate([prompts[0]], GREEDY, use_tqdm=False)[0]
    stop_id = base.token_ids[5]
    first = base.token_ids.index(stop_id)
    by_id = SamplingParams(max_tokens=20, temperature=0, stop_token_ids=[stop_id])
    out = llm.generate([prompts[0]], by_id, use_tqdm=False)[0]
    assert out.token_ids == base.token_ids[: first + 1]
    assert out.finish_reason == {"type": "stop", "matched": stop_id}
    stop_text = base.text[len(base.text) // 2 :][:3]
    by_text = SamplingParams(max_tokens=20, temperature=0, stop=[stop_text], ignore_eos=True)
    out = llm.generate([prompts[0]], by_text, use_tqdm=False)[0]
    assert out.finish_reason == {"type": "stop", "matched": stop_text}
    assert out.text == base.text[: base.text.index(stop_text)]
    short = llm.generate([prompts[0]], SamplingParams(max_tokens=4, temperature=0), False)[0]
    assert short.finish_reason["type"] in ("length", "stop") and len(short.token_ids) <= 4
    with_lp = SamplingParams(max_tokens=6, temperature=0, logprobs=3, ignore_eos=True)
    out = llm.generate([prompts[0]], with_lp, use_tqdm=False)[0]
    assert len(out.logprobs) == 6
    for token, lp in zip(out.token_ids, out.logprobs):
        assert lp.token_id == token and lp.top[0][0] == token and len(lp.top) == 3


def test_min_tokens_blocks_eos(checkpoint, prompts):
    llm = LLM(checkpoint, max_total_tokens=4096)
    eos = llm.engine.eos_token_ids[0]
    params = SamplingParams(max_tokens=8, temperature=0, min_tokens=8, stop_token_ids=[eos])
    for out in llm.generate(prompts[:4], params, use_tqdm=False):
        assert eos not in out.token_ids and len(out.token_ids) == 8


def test_bad_requests_are_refused(checkpoint):
    llm = LLM(checkpoint, max_total_tokens=256, page_size=4)
    with pytest.raises(ValueError, match="context length"):
        llm.generate([[1] * 300], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="input_ids"):
        llm.generate([[10**6]], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
