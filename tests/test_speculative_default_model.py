"""Speculative decoding on the embedded default model (skipped until its weights are present):
greedy outputs identical to plain decoding, and a mean accept length >= 2.0 with 3 steps on its
own kind of prompts (chat questions through its chat template)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from dsaserve import LLM, SamplingParams
from dsaserve.assets import default_model_path

MODEL = default_model_path()
QUESTIONS = [
    "What is 15% of 240?",
    "What is 37 times 24?",
    "What's the weather in Paris?",
    "What is 45% of 680?",
]

pytestmark = pytest.mark.skipif(
    not (MODEL / "config.json").is_file() or not any(MODEL.glob("*.safetensors")),
    reason="the embedded default model's weights are not in dsaserve/assets/default_model yet",
)


def _prompts(llm: LLM) -> list[list[int]]:
    tokenizer = llm.tokenizer
    out = []
    for question in QUESTIONS:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False
        )
        out.append(tokenizer(text, add_special_tokens=False).input_ids)
    return out


def _mtp_untrained() -> bool:
    """True while the MTP layer is still its initialisation (eh_proj = 0.7 [I | I])."""
    config = json.loads((MODEL / "config.json").read_text())
    name = f"model.layers.{config['num_hidden_layers']}.eh_proj.weight"
    with safe_open(str(next(MODEL.glob("*.safetensors"))), "pt") as f:
        weight = f.get_tensor(name).float()
    eye = torch.eye(weight.shape[0])
    return torch.allclose(weight, 0.7 * torch.cat([eye, eye], dim=1))


def test_default_model_greedy_identical_and_accept_length():
    params = SamplingParams(max_tokens=96, temperature=0)
    plain = LLM(max_total_tokens=16384)
    prompts = _prompts(plain)
    want = [o.token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    spec = LLM(max_total_tokens=16384, speculative_algorithm="EAGLE", speculative_num_steps=3)
    got = [o.token_ids for o in spec.generate(prompts, params, use_tqdm=False)]
    assert got == want
    if _mtp_untrained():
        pytest.skip("the embedded model's MTP layer is not trained yet (eh_proj is its init)")
    assert spec.engine.stats()["avg_spec_accept_length"] >= 2.0
