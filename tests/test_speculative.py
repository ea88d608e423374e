"""Speculative decoding (MTP drafts, target verification) gives the tokens of plain decoding.

Two kinds of drafts: the checkpoint's own MTP layer (random or pass-through weights: mostly
rejected) and an "oracle" that proposes the known greedy continuation with some tokens
corrupted, so every accept length from 0 to K happens and the KV bookkeeping after partial
accepts is exercised.
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict

import pytest
import torch
from speculative_models import check_native_verify, make_mtp_checkpoint, mixed_prompts

from dsaserve import LLM, SamplingParams
from dsaserve.engine.messages import GenerateRequest
from dsaserve.engine.spec.eagle import EagleDecoder

GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return str(make_mtp_checkpoint(tmp_path_factory.mktemp("spec") / "ckpt", "glm", seed=3))


@pytest.fixture(scope="module")
def prompts():
    return mixed_prompts()


@pytest.fixture(scope="module")
def plain(checkpoint, prompts):
    """Greedy outputs without speculation: what every speculative run must reproduce."""
    llm = LLM(checkpoint, max_total_tokens=8192, page_size=4)
    return [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def oracle(monkeypatch, references: dict[tuple[int, ...], list[int]], keep: float, seed: int = 0):
    """Replace the MTP draft by the known continuation, each token kept with prob `keep`."""
    rng = random.Random(seed)

    def draft(self: EagleDecoder, reqs):
        out = []
        for req in reqs:
            ref = references[tuple(req.prompt_ids)]
            n = len(req.output_ids)
            true = (ref[n : n + self.num_steps] + [0] * self.num_steps)[: self.num_steps]
            out.append([t if rng.random() < keep else rng.randrange(380) for t in true])
        return out

    monkeypatch.setattr(EagleDecoder, "_draft", draft)


def spec_llm(checkpoint, steps: int, **engine_args) -> LLM:
    args = {"max_total_tokens": 8192, "page_size": 4, **engine_args}
    return LLM(checkpoint, speculative_algorithm="EAGLE", speculative_num_steps=steps, **args)


def _ids(case) -> str:
    steps, args = case
    return f"steps{steps}-" + ",".join(f"{k}={v}" for k, v in args.items())


MTP_CASES = [(1, {}), (3, {"chunked_prefill_size": 7, "page_size": 1})]
ORACLE_CASES = [
    (1, {"page_size": 16, "max_running_requests": 3}),
    (3, {}),
    (3, {"chunked_prefill_size": 7, "page_size": 1}),
]


@pytest.mark.parametrize("case", MTP_CASES, ids=_ids)
def test_mtp_drafts_greedy_identical(checkpoint, prompts, plain, case):
    steps, engine_args = case
    llm = spec_llm(checkpoint, steps, **engine_args)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outputs] == plain
    stats = llm.engine.stats()
    assert stats["spec_verify_ct"] > 0 and stats["avg_spec_accept_length"] >= 1.0
    assert stats["kv_used_tokens"] == 0


@pytest.mark.parametrize("case", ORACLE_CASES, ids=_ids)
def test_oracle_drafts_greedy_identical(monkeypatch, checkpoint, prompts, plain, case):
    steps, engine_args = case
    oracle(monkeypatch, {tuple(p): o for p, o in zip(prompts, plain)}, keep=0.75, seed=steps)
    llm = spec_llm(checkpoint, steps, **engine_args)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outputs] == plain
    assert llm.engine.stats()["avg_spec_accept_length"] > 1.3


def test_native_verify_equals_layered(monkeypatch, checkpoint, prompts, plain):
    """An all-decode verify runs the native decode layers, the final hidden states (what the
    MTP layer reads) copied out as the last layer's tap: logits and states equal the layered
    model's on the same batch, and the tokens are plain decoding's."""
    checked = check_native_verify(monkeypatch)
    llm = spec_llm(checkpoint, 3)
    assert llm.engine.runner.decode_step.native is not None
    assert [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == plain
    assert checked and max(checked) > 4  # several requests' verify runs in one native call


def test_retraction_with_tiny_kv(monkeypatch, checkpoint, prompts, plain):
    oracle(monkeypatch, {tuple(p): o for p, o in zip(prompts, plain)}, keep=0.7)
    llm = spec_llm(checkpoint, 3, max_total_tokens=160, page_size=4)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outputs] == plain
    assert llm.engine.scheduler.num_retractions > 0
    assert llm.engine.stats()["kv_used_tokens"] == 0


def test_radix_hits(monkeypatch, checkpoint, prompts):
    shared = prompts[3] + prompts[6]  # 61 tokens: 60 cached with pages of 4
    fresh = LLM(checkpoint, max_total_tokens=4096, disable_radix_cache=True)
    tails = [[1, 2], [3, 4, 5], [6]]
    expected = [fresh.generate([shared + t], GREEDY, use_tqdm=False)[0].token_ids for t in tails]
    llm = spec_llm(checkpoint, 3)
    got = [llm.generate([shared + t], GREEDY, use_tqdm=False)[0] for t in tails]
    assert [o.token_ids for o in got] == expected
    assert got[0].cached_tokens == 0 and got[1].cached_tokens == 60


def test_mtp_cache_matches_teacher_forced(checkpoint, prompts):
    """The draft a request holds after many rounds (verify, partial accepts, catch-up) equals
    the one a fresh engine computes by prefilling the same tokens at once."""
    llm = spec_llm(checkpoint, 3)
    engine = llm.engine
    engine.add_request(GenerateRequest(rid="a", input_ids=prompts[3], sampling=asdict(GREEDY)))
    for _ in range(6):
        engine.step()
    req = engine.reqs["a"]
    draft = req.spec_draft
    assert draft.position == req.kv_len - 1 > len(prompts[3])
    other = spec_llm(checkpoint, 3).engine
    prefix = req.fill_ids[:-1]
    other.add_request(GenerateRequest(rid="b", input_ids=prefix, sampling=asdict(GREEDY)))
    other.step()
    fresh = other.reqs["b"].spec_draft
    assert other.reqs["b"].output_ids == [req.fill_ids[-1]]
    assert fresh.position == draft.position and fresh.token == draft.token
    torch.testing.assert_close(fresh.hidden, draft.hidden, atol=1e-4, rtol=1e-4)


def test_deepseek_and_index_share(tmp_path, monkeypatch):
    ckpt = str(make_mtp_checkpoint(tmp_path / "ds", "deepseek", seed=5, mode="random"))
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 380, (n,), generator=generator).tolist() for n in (30, 11, 4)]
    expected = [o.token_ids for o in LLM(ckpt, max_total_tokens=4096).generate(
        prompts, GREEDY, use_tqdm=False)]  # fmt: skip
    calls = {}
    for share in (False, True):
        override = json.dumps({"index_share_for_mtp_iteration": share})
        llm = spec_llm(ckpt, 3, json_model_override_args=override)
        indexer = llm.engine.model.mtp.self_attn.indexer
        counted = indexer.forward

        def counting(*args, _f=counted, _share=share, **kw):
            calls[_share] = calls.get(_share, 0) + 1
            return _f(*args, **kw)

        monkeypatch.setattr(indexer, "forward", counting)
        assert [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == expected
    # per step: the catch-up runs the MTP indexer; draft steps 2 and 3 only without sharing
    assert 2 * calls[True] < calls[False]


def test_stops_inside_accepted_runs(monkeypatch, checkpoint, prompts, plain):
    oracle(monkeypatch, {tuple(p): o for p, o in zip(prompts, plain)}, keep=1.0)
    base = LLM(checkpoint, max_total_tokens=4096)
    llm = spec_llm(checkpoint, 3)
    prompt, ref = prompts[3], plain[3]
    cases = [
        SamplingParams(max_tokens=24, temperature=0, stop_token_ids=[ref[6]]),
        SamplingParams(max_tokens=7, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=2),
    ]
    text = base.generate([prompt], GREEDY, use_tqdm=False)[0].text
    cases.append(SamplingParams(max_tokens=24, temperature=0, stop=[text[9:12]], ignore_eos=True))
    for params in cases:
        want = base.generate([prompt], params, use_tqdm=False)[0]
        got = llm.generate([prompt], params, use_tqdm=False)[0]
        assert got.token_ids == want.token_ids
        assert got.text == want.text and got.finish_reason == want.finish_reason
        if params.logprobs:
            assert [lp.token_id for lp in got.logprobs] == got.token_ids
            for a, b in zip(got.logprobs, want.logprobs):
                assert abs(a.logprob - b.logprob) < 1e-4
    assert llm.engine.stats()["kv_used_tokens"] == 0


def test_seeded_sampling_identical(monkeypatch, checkpoint, prompts):
    params = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=5, ignore_eos=True)
    base = LLM(checkpoint, max_total_tokens=4096)
    want = [o.token_ids for o in base.generate(prompts[:4], params, use_tqdm=False)]
    oracle(monkeypatch, {tuple(p): o for p, o in zip(prompts, want)}, keep=0.6)
    llm = spec_llm(checkpoint, 3)
    assert [o.token_ids for o in llm.generate(prompts[:4], params, use_tqdm=False)] == want


def test_reporting(monkeypatch, checkpoint, prompts, plain, caplog):
    oracle(monkeypatch, {tuple(p): o for p, o in zip(prompts, plain)}, keep=0.8)
    llm = spec_llm(checkpoint, 3)
    engine = llm.engine
    outputs = []
    with caplog.at_level("INFO", logger="dsaserve.engine.spec.eagle"):
        for i, prompt in enumerate(prompts):
            engine.add_request(GenerateRequest(rid=str(i), input_ids=prompt,
                                               sampling=asdict(GREEDY), stream=False))  # fmt: skip
        while engine.has_work():
            outputs += engine.step()
    assert len(outputs) == len(prompts)
    for out in outputs:
        assert out.spec_verify_ct > 0
        assert out.spec_accept_length == pytest.approx(out.completion_tokens / out.spec_verify_ct)
        assert out.spec_num_proposed_drafts == 3 * out.spec_verify_ct
        assert out.spec_accept_rate == pytest.approx(
            out.spec_num_correct_drafts / out.spec_num_proposed_drafts
        )
    stats = engine.stats()
    verify_tokens = sum(o.completion_tokens - 1 for o in outputs)
    assert stats["avg_spec_accept_length"] == pytest.approx(verify_tokens / stats["spec_verify_ct"])
    assert stats["avg_spec_accept_length"] > 1.5
    assert any("accept len:" in r.getMessage() and "accept rate:" in r.getMessage()
               for r in caplog.records)  # fmt: skip


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_greedy_identical_with_index_share(monkeypatch, checkpoint, prompts):
    base = LLM(checkpoint, max_total_tokens=8192, page_size=4, device="cuda")
    want = [o.token_ids for o in base.generate(prompts, GREEDY, use_tqdm=False)]
    share = '{"index_share_for_mtp_iteration": true}'
    llm = spec_llm(checkpoint, 3, device="cuda", json_model_override_args=share)
    assert [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == want
    oracle(monkeypatch, {tuple(p): o for p, o in zip(prompts, want)}, keep=0.75)
    llm = spec_llm(checkpoint, 3, device="cuda", chunked_prefill_size=7)
    assert [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == want
