"""With temperature 1.0, speculative decoding samples from the target's distribution.

A 16-token model; drafts always propose the most likely tokens (so they are accepted often and
rejected often). Over many unseeded requests, the tokens produced by verify steps (output
positions 1 and 2) must follow the marginals computed from the target's own logits; a
chi-square test at p = 0.001.
"""

from __future__ import annotations

import pytest
import torch
from engine_score import score
from safetensors.torch import load_file, save_file
from speculative_models import make_mtp_checkpoint

from dsaserve import LLM, SamplingParams
from dsaserve.engine.spec.eagle import EagleDecoder

VOCAB = 16
PROMPT = [3, 7, 1, 12, 5, 9]
SAMPLES = 600
LOGIT_SCALE = 8.0


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("spec_sampling") / "ckpt"
    make_mtp_checkpoint(folder, "glm", seed=11, vocab_size=VOCAB)
    tensors = load_file(str(folder / "model.safetensors"))
    tensors["lm_head.weight"] *= LOGIT_SCALE  # peaked distributions: a more powerful test
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return str(folder)


def _probs(llm: LLM, ids: list[int]) -> torch.Tensor:
    return score(llm.engine, ids)[-1, :VOCAB].double().softmax(-1)


def _marginals(llm: LLM) -> tuple[torch.Tensor, torch.Tensor]:
    """P(t1) and P(t2) of the target at temperature 1, by enumerating t0 and t1."""
    p0 = _probs(llm, PROMPT)
    p1_given = torch.stack([_probs(llm, PROMPT + [a]) for a in range(VOCAB)])  # [t0, t1]
    p2 = torch.zeros(VOCAB, dtype=torch.float64)
    for a in range(VOCAB):
        for b in range(VOCAB):
            p2 += p0[a] * p1_given[a, b] * _probs(llm, PROMPT + [a, b])
    return p0 @ p1_given, p2


def _chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    big = expected >= 5  # pool the small bins
    obs = torch.cat([counts[big], counts[~big].sum().view(1)])
    exp = torch.cat([expected[big], expected[~big].sum().view(1)])
    keep = exp > 0
    stat = ((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0), stat / 2))


def test_verify_tokens_follow_target_distribution(monkeypatch, checkpoint):
    plain = LLM(checkpoint, max_total_tokens=4096, page_size=4)
    p1, p2 = _marginals(plain)
    proposal = [int(p1.argmax()), int(p2.argmax())]

    def draft(self: EagleDecoder, reqs):
        return [proposal[: self.num_steps] for _ in reqs]

    monkeypatch.setattr(EagleDecoder, "_draft", draft)
    llm = LLM(checkpoint, max_total_tokens=1 << 16, page_size=4, speculative_algorithm="EAGLE",
              speculative_num_steps=2, max_running_requests=256, random_seed=123)  # fmt: skip
    params = SamplingParams(max_tokens=3, temperature=1.0, top_p=1.0, top_k=-1, ignore_eos=True)
    outputs = llm.generate([PROMPT] * SAMPLES, params, use_tqdm=False)
    tokens = torch.tensor([o.token_ids for o in outputs])  # [N, 3]
    counts1 = torch.bincount(tokens[:, 1], minlength=VOCAB).double()
    counts2 = torch.bincount(tokens[:, 2], minlength=VOCAB).double()
    accepted = (tokens[:, 1] == proposal[0]).double().mean()
    assert 0.05 < accepted < 0.95  # both branches of the acceptance test were taken
    assert _chi_square_p(counts1, p1) > 1e-3
    assert _chi_square_p(counts2, p2) > 1e-3
    # the test has power: the same counts against a wrong (the prompt's own) distribution fail
    assert _chi_square_p(counts1, _probs(plain, PROMPT)) < 1e-3
