"""A block-FP8 checkpoint serves the same logits as the model built from its dequantised weights."""

from __future__ import annotations

import json

import torch
from tiny_models import load_reference, make_checkpoint

from dsaserve import LLM
from dsaserve.models.fp8 import quantize_checkpoint


def test_fp8_checkpoint_matches_dequantised_model(tmp_path):
    source = make_checkpoint(tmp_path / "bf", "deepseek", seed=4)
    fp8 = tmp_path / "fp8"
    quantize_checkpoint(source, fp8, block=32)
    assert json.loads((fp8 / "config.json").read_text())["quantization_config"]["quant_method"]
    llm = LLM(str(fp8), dtype="float32", max_total_tokens=1024, page_size=4)
    # The reference: transformers' model holding exactly the weights dsaserve dequantised.
    reference = load_reference(source)
    reference.load_state_dict(llm.engine.model.state_dict(), strict=True)
    original = load_reference(source)
    prompt = torch.randint(0, 380, (41,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        expected = reference(torch.tensor([prompt])).logits[0]
        unquantised = original(torch.tensor([prompt])).logits[0]
    got = llm.engine.score(prompt)
    assert (got - expected).abs().max() / expected.abs().max() < 1e-4
    # and FP8 really changed the weights (the comparison above is not vacuous)
    assert (unquantised - expected).abs().max() > 1e-4
