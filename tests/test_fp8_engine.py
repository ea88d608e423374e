"""Block-FP8 checkpoints serve the logits of their dequantised weights; bf16 compute tracks fp32."""

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


def test_bf16_compute_tracks_fp32(tmp_path):
    folder = str(make_checkpoint(tmp_path / "m", "glm", seed=5))
    prompt = torch.randint(0, 380, (37,), generator=torch.Generator().manual_seed(2)).tolist()
    fp32 = LLM(folder, dtype="float32", max_total_tokens=512, page_size=4).engine
    bf16 = LLM(folder, dtype="bfloat16", max_total_tokens=512, page_size=4).engine
    assert bf16.pool.kv_cache.dtype == torch.bfloat16
    assert bf16.model.model.layers[1].mlp.gate.weight.dtype == torch.float32  # router stays fp32
    expected, got = fp32.score(prompt), bf16.score(prompt)
    # bf16 rounding may flip a discrete choice (an expert, a top-k token) for a few rows, so
    # compare in aggregate: small mean error and the same greedy token almost everywhere.
    assert (got - expected).abs().mean() / expected.abs().mean() < 3e-2
    assert (got.argmax(-1) == expected.argmax(-1)).float().mean() > 0.85
