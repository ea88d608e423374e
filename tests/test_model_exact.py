"""The model against the transformers reference classes on random small configs.

Prompts are both shorter and several times longer than index_topk (8), so the DSA sparse path
runs; GLM uses indexer_types with a shared layer, DeepSeek n_group > 1 and YaRN.
"""

from __future__ import annotations

import pytest
import torch
from engine_score import score
from tiny_models import load_reference, make_checkpoint

from dsaserve import LLM, SamplingParams

CASES = [
    ("glm", 0, {"indexer_types": ["full", "shared", "full"]}),
    ("glm", 1, {}),
    ("deepseek", 0, {}),
    ("deepseek", 2, {"index_topk": 16}),
]
PROMPT_LENS = (5, 30, 57)
NEW_TOKENS = 64


@pytest.fixture(scope="module", params=CASES, ids=lambda c: f"{c[0]}-seed{c[1]}")
def case(request, tmp_path_factory):
    kind, seed, overrides = request.param
    folder = make_checkpoint(tmp_path_factory.mktemp(kind) / "ckpt", kind, seed, **overrides)
    llm = LLM(str(folder), page_size=4, max_total_tokens=4096, chunked_prefill_size=24)
    generator = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, 380, (n,), generator=generator).tolist() for n in PROMPT_LENS]
    return load_reference(folder), llm, prompts


def test_prefill_logits_match_reference(case):
    reference, llm, prompts = case
    for prompt in prompts:
        with torch.no_grad():
            expected = reference(torch.tensor([prompt])).logits[0]
        got = score(llm.engine, prompt)
        scale = expected.abs().max()
        assert (got - expected).abs().max() / scale < 1e-4, f"prompt of {len(prompt)} tokens"


def test_greedy_tokens_match_reference_in_mixed_batch(case):
    reference, llm, prompts = case
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outputs):
        expected = reference_greedy(reference, prompt, NEW_TOKENS)
        assert out.token_ids == expected, f"prompt of {len(prompt)} tokens"
        assert out.finish_reason == {"type": "length", "matched": None}


@torch.no_grad()
def reference_greedy(reference, prompt: list[int], new_tokens: int) -> list[int]:
    """Greedy decoding by full forwards of the reference: transformers' own `generate` cache path
    disagrees with its forward on some of these configs (shared indexer layers, DeepSeek)."""
    ids = list(prompt)
    for _ in range(new_tokens):
        ids.append(int(reference(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def test_row_blocked_workspace_gives_the_same_logits(case, monkeypatch):
    """A tiny workspace splits every long run into many row blocks (what bounds memory for
    long prompts); the logits must not change."""
    reference, llm, prompts = case
    monkeypatch.setattr("dsaserve.layers.indexer.WORKSPACE", 256)
    with torch.no_grad():
        expected = reference(torch.tensor([prompts[-1]])).logits[0]
    got = score(llm.engine, prompts[-1])
    assert (got - expected).abs().max() / expected.abs().max() < 1e-4
