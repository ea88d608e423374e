"""Block-FP8 checkpoints serve the logits of their dequantised weights; bf16 compute tracks fp32."""

from __future__ import annotations

import json

import torch
from engine_score import score
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
    got = score(llm.engine, prompt)
    assert (got - expected).abs().max() / expected.abs().max() < 1e-4
    # and FP8 really changed the weights (the comparison above is not vacuous)
    assert (unquantised - expected).abs().max() > 1e-4


def test_bf16_compute_is_as_faithful_as_the_reference_in_bf16(tmp_path):
    folder = make_checkpoint(tmp_path / "m", "glm", seed=5)
    prompt = torch.randint(0, 380, (37,), generator=torch.Generator().manual_seed(2)).tolist()
    bf16 = LLM(str(folder), dtype="bfloat16", max_total_tokens=512, page_size=4).engine
    assert bf16.pool.kv_cache.dtype == torch.bfloat16
    assert bf16.model.model.layers[1].mlp.gate.weight.dtype == torch.float32  # router stays fp32
    reference = load_reference(folder)
    with torch.no_grad():
        exact = reference(torch.tensor([prompt])).logits[0]
        reference_bf16 = reference.to(torch.bfloat16)(torch.tensor([prompt])).logits[0].float()
    got = score(bf16, prompt)
    # bf16 rounding flips a few discrete choices (experts, top-k tokens) in a random model, so
    # the bar is the reference's own bf16 error, not a fixed tolerance.
    error = lambda x: ((x - exact).abs().mean() / exact.abs().mean()).item()  # noqa: E731
    assert error(got) <= 1.2 * error(reference_bf16)
    assert (got.argmax(-1) == exact.argmax(-1)).float().mean() > 0.8
