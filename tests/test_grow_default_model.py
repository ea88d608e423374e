"""`scripts/grow_default_model.py` (block expansion): the deeper checkpoint computes exactly what
the source computes, in transformers and in dsaserve with its MTP layer drafting."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from speculative_models import make_mtp_checkpoint
from transformers import AutoModelForCausalLM

from dsaserve import LLM, SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from grow_default_model import grow  # noqa: E402


def test_grown_checkpoint_computes_the_same(tmp_path: Path):
    src = make_mtp_checkpoint(tmp_path / "src", mode="echo")
    dst = tmp_path / "dst"
    grow(src, dst, layers=5)
    config = json.loads((dst / "config.json").read_text())
    assert config["num_hidden_layers"] == 5
    assert config["mlp_layer_types"] == ["dense"] + ["sparse"] * 4

    ids = torch.randint(1, 300, (2, 40))  # longer than index_topk: the sparse path runs
    want = AutoModelForCausalLM.from_pretrained(src)(ids).logits
    got = AutoModelForCausalLM.from_pretrained(dst)(ids).logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)

    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    prompts = [list(range(5, 45)), list(range(100, 112))]
    spec = {"speculative_algorithm": "EAGLE", "speculative_num_steps": 2}
    tokens, accept = {}, {}
    for folder in (src, dst):
        llm = LLM(str(folder), max_total_tokens=2048, **spec)
        tokens[folder] = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        accept[folder] = llm.engine.stats()["avg_spec_accept_length"]
    assert tokens[dst] == tokens[src]
    assert accept[dst] == accept[src]  # the same drafts accepted: the MTP layer moved intact
