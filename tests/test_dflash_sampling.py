"""Under sampling, DFLASH's rejection sampling emits the target's distribution.

A 16-token model and a random drafter whose drafts are drawn from its own q (DFlash2: the
selector's softmax over its top-4 candidates at the request's temperature; DFlash: the drafter's
logits at the request's temperature and top-k), so drafts are accepted often and rejected often.
Over 600 unseeded requests, the tokens that verify steps emit (output positions 1 and 2; position
0 comes from the prefill) must follow the marginals computed from the target's own logits under
the same temperature and top-k: a chi-square test at p = 0.001 (a correct sampler fails it one
time in a thousand). Power: the same counts against the first output token's distribution (what
a verifier that sampled every row from the wrong context would give) must fail it, and a broken
verifier that accepts every draft (its tokens then follow the drafter's q) fails it in
`test_accepting_every_draft_is_caught`. Seeded requests keep their tokens: a seeded
request draws with the engine's own (seed, step) uniforms and greedy drafts, as without
speculation.
"""

from __future__ import annotations

import pytest
import torch
from dflash_models import write_drafter
from safetensors.torch import load_file, save_file
from test_speculative_sampling import _chi_square_p
from tiny_models import load_reference, make_checkpoint

from dsaserve import LLM, SamplingParams
from dsaserve.engine.sampler import filtered_probs
from dsaserve.engine.spec.verify import Acceptor

VOCAB = 16
PROMPT = [3, 7, 1, 12, 5, 9]
SAMPLES = 600
LOGIT_SCALE = 6.0
CASES = {"dflash2": (True, 1.0, -1), "dflash": (False, 0.8, 8)}  # v2, temperature, top_k


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    folder = tmp_path_factory.mktemp("dflash_sampling") / "ckpt"
    make_checkpoint(folder, "glm", seed=11, vocab_size=VOCAB)
    tensors = load_file(str(folder / "model.safetensors"))
    tensors["lm_head.weight"] *= LOGIT_SCALE  # peaked distributions: a more powerful test
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def _probs(model, prefixes: list[list[int]], params: SamplingParams) -> torch.Tensor:
    """[N, VOCAB] the target's next-token distributions after each prefix (one batched
    transformers forward; prefixes of one length), filtered as the sampler filters."""
    with torch.no_grad():
        logits = model(torch.tensor(prefixes)).logits[:, -1, :VOCAB].float()
    return filtered_probs(logits, [params.with_defaults({})] * len(prefixes)).double()


def _marginals(target, params: SamplingParams) -> tuple[torch.Tensor, ...]:
    """P(t0), P(t1) and P(t2) of the target under `params`, by enumerating t0 and t1."""
    model = load_reference(target)
    p0 = _probs(model, [PROMPT], params)[0]
    p1_given = _probs(model, [PROMPT + [a] for a in range(VOCAB)], params)  # [t0, t1]
    pairs = [PROMPT + [a, b] for a in range(VOCAB) for b in range(VOCAB)]
    p2_given = _probs(model, pairs, params).view(VOCAB, VOCAB, VOCAB)  # [t0, t1, t2]
    joint = p0[:, None] * p1_given  # [t0, t1]
    return p0, p0 @ p1_given, torch.einsum("ab,abc->c", joint, p2_given)


def _run(target, drafter, params, seed=123, **kw) -> tuple[torch.Tensor, dict]:
    llm = LLM(str(target), max_total_tokens=1 << 16, page_size=4, speculative_algorithm="DFLASH",
              speculative_draft_model_path=str(drafter), max_running_requests=256,
              random_seed=seed, **kw)  # fmt: skip
    outputs = llm.generate([PROMPT] * SAMPLES, params, use_tqdm=False)
    return torch.tensor([o.token_ids for o in outputs]), llm.engine.stats()


@pytest.mark.parametrize("case", list(CASES))
def test_verify_tokens_follow_target_distribution(target, tmp_path, case):
    v2, temperature, top_k = CASES[case]
    params = SamplingParams(max_tokens=3, temperature=temperature, top_p=1.0, top_k=top_k,
                            ignore_eos=True)  # fmt: skip
    p0, p1, p2 = _marginals(target, params)
    drafter = write_drafter(tmp_path / "d", target, seed=2, v2=v2, block_size=3)
    tokens, stats = _run(target, drafter, params)
    assert 0.05 < stats["spec_accept_rate"] < 0.95  # both branches of the test were taken
    counts1 = torch.bincount(tokens[:, 1], minlength=VOCAB).double()
    counts2 = torch.bincount(tokens[:, 2], minlength=VOCAB).double()
    assert _chi_square_p(counts1, p1) > 1e-3
    assert _chi_square_p(counts2, p2) > 1e-3
    assert _chi_square_p(counts1, p0) < 1e-3  # power: the first token's distribution
    assert _chi_square_p(counts2, p0) < 1e-3


def test_accepting_every_draft_is_caught(monkeypatch, target, tmp_path):
    """A verifier that keeps every draft emits the drafter's q: the same test rejects it."""
    params = SamplingParams(max_tokens=3, temperature=1.0, top_p=1.0, top_k=-1, ignore_eos=True)
    _, p1, _ = _marginals(target, params)
    drafter = write_drafter(tmp_path / "d", target, seed=2, v2=True, block_size=3)
    original = Acceptor._reject

    def accept_all(self, p, rows, r, proposals, draft_tokens):
        original(self, p, rows, r, proposals, draft_tokens)  # same random stream
        return list(draft_tokens), [True] * len(draft_tokens)

    monkeypatch.setattr(Acceptor, "_reject", accept_all)
    tokens, _ = _run(target, drafter, params)
    counts1 = torch.bincount(tokens[:, 1], minlength=VOCAB).double()
    assert _chi_square_p(counts1, p1) < 1e-3


def test_seeded_sampling_keeps_its_tokens(target, tmp_path):
    drafter = write_drafter(tmp_path / "d", target, seed=2, block_size=4)
    params = [SamplingParams(max_tokens=12, temperature=1.0, seed=s, ignore_eos=True)
              for s in range(8)]  # fmt: skip
    plain = LLM(str(target), max_total_tokens=4096, page_size=4)
    spec = LLM(str(target), max_total_tokens=4096, page_size=4, speculative_algorithm="DFLASH",
               speculative_draft_model_path=str(drafter))  # fmt: skip
    want = [o.token_ids for o in plain.generate([PROMPT] * 8, params, use_tqdm=False)]
    got = [o.token_ids for o in spec.generate([PROMPT] * 8, params, use_tqdm=False)]
    assert got == want
