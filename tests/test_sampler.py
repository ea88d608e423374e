from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from dsaserve.engine.sampler import Sampler, SamplingState, _apply_penalties, _top_p
from dsaserve.sampling_params import SamplingParams

EOS = 0


def make_state(prompt: list[int] | None = None, vocab: int = 16, **kw) -> SamplingState:
    params = SamplingParams(**kw).with_defaults({})
    return SamplingState(params, prompt or [], vocab, [EOS])


def sample_counts(probs: list[float], draws: int, **kw) -> Counter:
    """Draw `draws` tokens at once: one row per draw, all with the same logits."""
    logits = torch.tensor(probs).log().expand(draws, -1).contiguous()
    states = [make_state(vocab=len(probs), **kw) for _ in range(draws)]
    return Counter(Sampler(seed=1)(logits, states).token_ids)


def chi_square(counts: Counter, probs: list[float], draws: int) -> float:
    return sum((counts[i] - draws * p) ** 2 / (draws * p) for i, p in enumerate(probs) if p > 0)


def test_greedy_is_argmax_for_any_float_dtype():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=gen)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        states = [make_state(vocab=50, temperature=0.0) for _ in range(6)]
        out = Sampler()(logits.to(dtype), states)
        assert out.token_ids == logits.to(dtype).argmax(-1).tolist()
        assert out.logprobs == [None] * 6


def test_top_k_one_is_greedy_even_at_high_temperature():
    logits = torch.randn(8, 40, generator=torch.Generator().manual_seed(1))
    states = [make_state(vocab=40, temperature=2.0, top_k=1) for _ in range(8)]
    assert Sampler()(logits, states).token_ids == logits.argmax(-1).tolist()


def run_seeded(logits_per_step: list[torch.Tensor], row: int, fillers: int, seed: int) -> list:
    """Sample one seeded request for several steps inside a batch of unseeded fillers."""
    target = make_state(vocab=logits_per_step[0].shape[0], temperature=1.0, seed=seed)
    sampler = Sampler(seed=fillers)
    gen = torch.Generator().manual_seed(100 + fillers)
    tokens = []
    for step_logits in logits_per_step:
        batch = [make_state(vocab=step_logits.shape[0], temperature=1.0) for _ in range(fillers)]
        batch.insert(row, target)
        logits = torch.randn(len(batch), step_logits.shape[0], generator=gen)
        logits[row] = step_logits
        token = sampler(logits, batch).token_ids[row]
        target.append(token)
        tokens.append(token)
    return tokens


def test_seeded_tokens_do_not_depend_on_batch_or_row():
    gen = torch.Generator().manual_seed(2)
    steps = [torch.randn(500, generator=gen) for _ in range(12)]
    alone = run_seeded(steps, row=0, fillers=0, seed=1234)
    assert run_seeded(steps, row=3, fillers=5, seed=1234) == alone
    assert run_seeded(steps, row=0, fillers=9, seed=1234) == alone
    assert run_seeded(steps, row=7, fillers=7, seed=1234) == alone


def test_different_seeds_give_different_tokens():
    steps = [torch.zeros(1000) for _ in range(10)]  # uniform: all tokens equally likely
    runs = {tuple(run_seeded(steps, row=0, fillers=0, seed=s)) for s in range(4)}
    assert len(runs) == 4
    assert all(len(set(run)) > 5 for run in runs)  # each step draws afresh


def test_unseeded_rows_differ_from_each_other_and_across_steps():
    counts = sample_counts([1.0] * 100, draws=200, temperature=1.0)
    assert len(counts) > 50


@pytest.mark.parametrize(
    ("kw", "support"),
    [
        ({"top_k": 2}, {0, 1}),
        ({"top_k": 3}, {0, 1, 2}),
        ({"top_p": 0.7}, {0, 1}),
        ({"top_p": 0.8}, {0, 1, 2}),
        ({"top_p": 0.4}, {0}),
        ({"min_p": 0.4}, {0, 1}),
        ({"min_p": 0.25}, {0, 1, 2}),
        ({"top_k": 3, "top_p": 0.7}, {0, 1}),
        ({}, {0, 1, 2, 3}),
    ],
)
def test_filters_restrict_the_support(kw, support):
    counts = sample_counts([0.5, 0.25, 0.15, 0.1], draws=3000, temperature=1.0, **kw)
    assert set(counts) == support


def test_top_p_applies_to_the_top_k_renormalised_distribution():
    # top_k=2 keeps tokens 0 and 1, renormalised to [0.66, 0.34]: top_p=0.6 is then reached by
    # token 0 alone (on the raw distribution, 0.45 < 0.6 would also keep token 1).
    probs = [0.45, 0.23, 0.14, 0.18]
    assert set(sample_counts(probs, draws=2000, temperature=1.0, top_k=2, top_p=0.6)) == {0}
    counts = sample_counts(probs, draws=3000, temperature=1.0, top_k=2, top_p=0.9)
    assert set(counts) == {0, 1}
    assert abs(counts[0] / 3000 - 0.45 / 0.68) < 0.04


def test_top_p_falls_back_to_a_full_sort_for_flat_distributions():
    probs = [1 / 1000] * 1000
    counts = sample_counts(probs, draws=2000, temperature=1.0, top_p=0.5)
    assert len(counts) > 300
    assert max(counts) < 1000  # tokens are kept up to the cutoff tie, i.e. everything


def naive_top_p(row: torch.Tensor, top_p: float) -> torch.Tensor:
    """Reference nucleus over the full sort: keep tokens until the mass reaches top_p."""
    kept, mass = torch.zeros_like(row, dtype=torch.bool), 0.0
    for value, index in zip(*row.sort(descending=True)):
        if mass >= top_p:
            kept |= row == row[kept].min()  # ties with the last kept token stay
            break
        kept[index], mass = True, mass + value.item()
    return kept


@pytest.mark.parametrize("scale", [0.1, 1.0, 4.0, 12.0])
def test_top_p_fast_candidates_match_a_full_sort(scale):
    gen = torch.Generator().manual_seed(int(scale * 10))
    probs = (torch.randn(6, 3000, generator=gen, dtype=torch.float64) * scale).softmax(-1)
    top_ps = [0.3, 0.5, 0.9, 0.95, 0.99, 1.0]
    got = _top_p(probs, torch.tensor(top_ps, dtype=torch.float64).unsqueeze(1)) > 0
    for row, top_p in enumerate(top_ps):
        want = naive_top_p(probs[row], top_p) if top_p < 1 else torch.ones(3000, dtype=torch.bool)
        assert torch.equal(got[row], want), (scale, top_p)


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_sampling_matches_softmax(temperature):
    probs = [0.4, 0.3, 0.2, 0.1]
    draws = 6000
    counts = sample_counts(probs, draws=draws, temperature=temperature)
    tempered = torch.tensor(probs).log().div(temperature).softmax(-1).tolist()
    assert chi_square(counts, tempered, draws) < 16.3  # df=3, p=0.001


def test_seeded_draws_over_many_seeds_match_softmax():
    probs = [0.4, 0.3, 0.2, 0.1]
    draws = 4000
    logits = torch.tensor(probs).log().expand(draws, -1).contiguous()
    states = [make_state(vocab=4, temperature=1.0, seed=s) for s in range(draws)]
    counts = Counter(Sampler()(logits, states).token_ids)
    assert chi_square(counts, probs, draws) < 16.3


def naive_penalties(logits: torch.Tensor, state: SamplingState, prompt: list[int]) -> torch.Tensor:
    out = logits.clone()
    p = state.params
    for token in set(prompt) | set(state.output_ids):
        value = out[token].item()
        out[token] = value / p.repetition_penalty if value > 0 else value * p.repetition_penalty
    for token, count in Counter(state.output_ids).items():
        out[token] -= p.frequency_penalty * count + p.presence_penalty
    return out


def test_penalties_change_logits_as_specified():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 30, generator=gen) * 3
    prompts = [[1, 2, 2, 5], [7], [3, 4], [9]]
    kws = [
        {"repetition_penalty": 1.3},
        {"frequency_penalty": 0.5, "presence_penalty": -0.7},
        {"repetition_penalty": 0.8, "frequency_penalty": 1.0, "presence_penalty": 1.5},
        {},
    ]
    states = [make_state(prompt, vocab=30, **kw) for prompt, kw in zip(prompts, kws)]
    outputs = [[5, 5, 6], [7, 8, 8, 8], [4, 10, 10], [9, 9]]
    for state, out in zip(states, outputs):
        for token in out:
            state.append(token)
    rows = zip(logits, states, prompts)
    expected = torch.stack([naive_penalties(row, s, p) for row, s, p in rows])
    work = logits.clone()
    _apply_penalties(work, states)
    torch.testing.assert_close(work, expected)
    assert not torch.equal(work[:3], logits[:3])
    assert torch.equal(work[3], logits[3])


def test_penalties_steer_greedy_choice():
    logits = torch.tensor([[0.0, 2.0, 1.9, 1.0]])
    state = make_state(vocab=4, temperature=0.0, presence_penalty=0.5)
    sampler = Sampler()
    assert sampler(logits, [state]).token_ids == [1]
    state.append(1)
    assert sampler(logits, [state]).token_ids == [2]


def test_min_tokens_masks_eos_and_stop_token_ids():
    logits = torch.tensor([[9.0, 8.0, 7.0, 1.0, 0.0]])  # EOS=0, stop token 1, then 2
    state = make_state(vocab=5, temperature=0.0, min_tokens=3, stop_token_ids=[1])
    sampler = Sampler()
    chosen = []
    for _ in range(4):
        token = sampler(logits, [state]).token_ids[0]
        state.append(token)
        chosen.append(token)
    assert chosen == [2, 2, 2, 0]


def test_min_tokens_masks_eos_when_sampling():
    counts = sample_counts([0.9, 0.05, 0.05], draws=500, temperature=1.0, min_tokens=1)
    assert EOS not in counts and set(counts) == {1, 2}


def test_logprobs_are_raw_log_softmax_with_ordered_top():
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(3, 64, generator=gen) * 2
    states = [
        make_state([5, 6], vocab=64, temperature=0.7, top_k=5, repetition_penalty=1.5, logprobs=4),
        make_state(vocab=64, temperature=0.0, logprobs=0),
        make_state(vocab=64, temperature=0.0),
    ]
    out = Sampler()(logits, states)
    reference = torch.log_softmax(logits, dim=-1)
    for row in range(2):
        entry = out.logprobs[row]
        assert entry.token_id == out.token_ids[row]
        assert math.isclose(entry.logprob, reference[row, entry.token_id].item(), abs_tol=1e-5)
    top_vals, top_ids = reference[0].topk(4)
    assert [t for t, _ in out.logprobs[0].top] == top_ids.tolist()
    assert [v for _, v in out.logprobs[0].top] == pytest.approx(top_vals.tolist(), abs=1e-5)
    assert out.logprobs[1].top == []
    assert out.logprobs[2] is None


def test_padded_vocab_columns_are_never_chosen_and_input_is_untouched():
    logits = torch.zeros(50, 12)
    logits[:, 10:] = 100.0  # padding columns beyond the real vocab of 10
    before = logits.clone()
    states = [make_state(vocab=10, temperature=1.0, repetition_penalty=2.0) for _ in range(50)]
    out = Sampler()(logits, states)
    assert max(out.token_ids) < 10
    assert torch.equal(logits, before)


def test_state_rejects_unresolved_params():
    with pytest.raises(ValueError, match="with_defaults"):
        SamplingState(SamplingParams(), [1], 10, [0])


def test_logits_and_states_must_match():
    with pytest.raises(ValueError, match="do not match"):
        Sampler()(torch.zeros(2, 5), [make_state(vocab=5)])


def test_non_contiguous_logits_give_the_same_tokens():
    logits = torch.randn(40, 6, generator=torch.Generator().manual_seed(5)).t()  # [6, 40] view

    def states() -> list[SamplingState]:
        kw = {"temperature": 0.8, "repetition_penalty": 1.2}
        return [make_state([1, 2], vocab=40, seed=i, **kw) for i in range(6)]

    contiguous = Sampler()(logits.contiguous(), states()).token_ids
    assert Sampler()(logits, states()).token_ids == contiguous


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_sampling_matches_cpu_greedy_and_is_batch_independent():
    logits = torch.randn(16, 4000, generator=torch.Generator().manual_seed(6))
    greedy = [make_state(vocab=4000, temperature=0.0, presence_penalty=0.5) for _ in range(16)]
    for state in greedy:
        state.append(int(logits[0].argmax()))
    assert Sampler()(logits.cuda(), greedy).token_ids == Sampler()(logits, greedy).token_ids
    seeded = make_state(vocab=4000, temperature=1.0, top_p=0.9, seed=11)
    batch = [make_state(vocab=4000, temperature=1.0) for _ in range(16)]
    batch[5] = seeded
    alone = Sampler()(logits[5:6].cuda(), [seeded]).token_ids[0]
    assert Sampler(seed=3)(logits.cuda(), batch).token_ids[5] == alone
