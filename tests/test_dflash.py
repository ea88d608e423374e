"""DFLASH speculative decoding gives the tokens of plain decoding (greedy), on random GLM and
DeepSeek-V3.2 targets with random published-format drafters (DFlash2 and DFlash), over mixed
prompt lengths, chunked prefill, small pages and radix hits.

Two kinds of drafts: the random drafter's own (mostly rejected) and an "oracle" that proposes
the known greedy continuation with some tokens corrupted, so every accept length from 0 to K
happens and the KV and drafter-context bookkeeping after partial accepts is exercised.
"""

from __future__ import annotations

import random

import pytest
from dflash_models import write_drafter
from speculative_models import check_native_verify, mixed_prompts
from tiny_models import make_checkpoint

from dsaserve import LLM, SamplingParams
from dsaserve.engine.spec.draft import Drafter
from dsaserve.engine.spec.verify import Proposals

GREEDY = SamplingParams(max_tokens=14, temperature=0, ignore_eos=True)
BASE = dict(max_total_tokens=8192, page_size=4)


@pytest.fixture(scope="module", params=["glm", "deepseek"])
def target(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(f"dflash_{request.param}") / "ckpt"
    return make_checkpoint(folder, request.param, seed=5)


@pytest.fixture(scope="module")
def prompts():
    return mixed_prompts()


@pytest.fixture(scope="module")
def plain(target, prompts):
    llm = LLM(str(target), **BASE)
    return [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def _llm(target, drafter, **kw) -> LLM:
    return LLM(str(target), speculative_algorithm="DFLASH",
               speculative_draft_model_path=str(drafter), **{**BASE, **kw})  # fmt: skip


@pytest.mark.parametrize("v2", [True, False], ids=["dflash2", "dflash"])
def test_random_drafter_greedy_equals_plain(target, prompts, plain, tmp_path, v2):
    drafter = write_drafter(tmp_path / "drafter", target, seed=1, v2=v2, block_size=4)
    llm = _llm(target, drafter)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outputs] == plain
    stats = llm.engine.stats()
    assert stats["spec_verify_ct"] > 0 and stats["spec_block_size"] == 4
    assert 1.0 <= stats["avg_spec_accept_length"] <= 4.0


def oracle(monkeypatch, references: dict[tuple[int, ...], list[int]], keep: float, seed: int = 0):
    """Replace the drafter's proposals by the known continuation, each token kept with `keep`."""
    rng = random.Random(seed)

    def propose(self: Drafter, reqs, sampled, sampler):
        k, out = self.block_size - 1, []
        for req in reqs:
            ref, n = references[tuple(req.prompt_ids)], len(req.output_ids)
            true = (ref[n : n + k] + [0] * k)[:k]
            out.append([t if rng.random() < keep else rng.randrange(380) for t in true])
        return Proposals(out, None, None)

    monkeypatch.setattr(Drafter, "propose", propose)


@pytest.mark.parametrize("keep,block,extra", [
    (1.0, 8, {}),
    (0.8, 4, {"chunked_prefill_size": 7}),
    (0.5, 6, {"chunked_prefill_size": 3, "max_running_requests": 3}),
    (0.9, 8, {"page_size": 1}),
])  # fmt: skip
def test_oracle_drafts_every_accept_length(monkeypatch, target, prompts, plain, tmp_path, keep,
                                           block, extra):  # fmt: skip
    drafter = write_drafter(tmp_path / "drafter", target, seed=2, block_size=block)
    oracle(monkeypatch, {tuple(p): o for p, o in zip(prompts, plain)}, keep)
    llm = _llm(target, drafter, **extra)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outputs] == plain
    stats = llm.engine.stats()
    if keep == 1.0:  # every draft accepted: B tokens per verify until max_tokens cuts it
        assert stats["spec_accept_rate"] > 0.8  # (the last verify of each is cut at max_tokens)
    else:
        assert 0.0 < stats["spec_accept_rate"] < 1.0


def test_radix_hits_and_batches_equal_plain(target, prompts, plain, tmp_path):
    """Second pass: every prompt's prefix is in the radix cache (its drafter entries too)."""
    drafter = write_drafter(tmp_path / "drafter", target, seed=3, block_size=5)
    llm = _llm(target, drafter)
    first = [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    again = llm.generate(prompts[::-1], GREEDY, use_tqdm=False)
    assert first == plain
    assert [o.token_ids for o in again] == plain[::-1]
    assert sum(o.cached_tokens for o in again) > 0
    one = [llm.generate([p], GREEDY, use_tqdm=False)[0].token_ids for p in prompts[:3]]
    assert one == plain[:3]


def test_tensor_parallel_ranks_equal_plain(prompts, tmp_path):
    """--tp 2: the verify forward's taps come back from the leader's shard, the block embeddings
    through an EMBED round; the drafter runs on the leader."""
    target = make_checkpoint(tmp_path / "ckpt", "glm", seed=8)
    drafter = write_drafter(tmp_path / "drafter", target, seed=4, block_size=4)
    want = [o.token_ids for o in LLM(str(target), **BASE).generate(prompts, GREEDY,
                                                                   use_tqdm=False)]  # fmt: skip
    with _llm(target, drafter, tp_size=2) as llm:
        got = [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
        stats = llm.engine.stats()
        assert stats["spec_verify_ct"] > 0
        # every rank's verify forward ran its native layers (taps copied out in the C++ call)
        assert stats["rank_decode_paths"] == ["native"] * 2 and stats["native_rank_rounds"] > 0
    assert got == want


def test_structured_output_masks_verification(tmp_path):
    """Each verify row is sampled under the grammar after the tokens accepted before it, so a
    draft the grammar forbids is never accepted and constrained greedy output is unchanged."""
    from test_structured_speculative import GRAMMARS, greedy

    target = make_checkpoint(tmp_path / "ckpt", "glm", seed=3)
    drafter = write_drafter(tmp_path / "drafter", target, seed=5, block_size=6)
    prompts = [[5, 17, 99, 3, 250, 41, 7], [300, 2, 64, 8]]
    plain, spec = LLM(str(target), **BASE), _llm(target, drafter)
    for kind, value in GRAMMARS:
        want = plain.generate(prompts, greedy(**{kind: value}), use_tqdm=False)
        got = spec.generate(prompts, greedy(**{kind: value}), use_tqdm=False)
        assert [o.token_ids for o in got] == [o.token_ids for o in want], value
    assert spec.engine.stats()["spec_verify_ct"] > 0


def test_native_verify_taps_equal_layered(monkeypatch, prompts, plain, target, tmp_path):
    """An all-decode verify runs the native decode layers, which copy the drafter's target
    layers out in the same C++ call (the last one after the final norm): each such step's logits
    and taps equal the layered model's `forward(taps)` on the same batch (fp32, 1e-4), and the
    tokens are plain decoding's."""
    checked = check_native_verify(monkeypatch)
    drafter = write_drafter(tmp_path / "drafter", target, seed=6, block_size=4)
    llm = _llm(target, drafter)
    assert llm.engine.runner.decode_step.native is not None
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outputs] == plain
    assert checked and max(checked) > 4  # several requests' blocks in one native call


def test_bf16_verify_on_native_layers(target, prompts, tmp_path):
    """bf16 (how GLM-5.3's DFlash2 drafter is served): the native layers compute the verify in
    fp32 and hand the drafter its taps in bf16; every request runs to its length, and greedy
    tokens agree with plain bf16 decoding on most prompts (bf16 paths may part at a near-tie,
    see test_tie_break_paths)."""
    plain = LLM(str(target), dtype="bfloat16", **BASE)
    want = [o.token_ids for o in plain.generate(prompts, GREEDY, use_tqdm=False)]
    drafter = write_drafter(tmp_path / "drafter", target, seed=1, block_size=4)
    llm = _llm(target, drafter, dtype="bfloat16")
    assert llm.engine.runner.decode_step.native is not None
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.finish_reason["type"] for o in outputs] == ["length"] * len(prompts)
    assert llm.engine.stats()["spec_verify_ct"] > 0
    equal = sum(o.token_ids == w for o, w in zip(outputs, want))
    assert equal >= len(prompts) // 2, f"{equal} of {len(prompts)} prompts identical"
