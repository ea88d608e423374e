"""NVFP4 (Model Optimizer) checkpoints: the format, and logits equal to the dequantised twin's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch
from engine_score import score
from safetensors import safe_open
from tiny_models import load_reference

from dsaserve import LLM
from dsaserve.kernels.nvfp4 import dequantize_nvfp4, pack_e2m1, quantize_nvfp4, unpack_e2m1

ROOT = Path(__file__).resolve().parents[1]


def test_e2m1_codes_and_nibble_order() -> None:
    packed = torch.tensor([[0x21, 0xF7]], dtype=torch.uint8)  # low nibble first
    assert unpack_e2m1(packed).tolist() == [[0.5, 1.0, 6.0, -6.0]]
    values = torch.tensor([[0.0, 0.5, 1.5, 3.0, -4.0, -0.5, 6.0, 2.0]])
    assert torch.equal(unpack_e2m1(pack_e2m1(values)), values)


def test_quantize_round_trip_is_within_the_format_error() -> None:
    w = torch.randn(32, 64)
    parts = quantize_nvfp4(w)
    assert parts[""].dtype == torch.uint8 and parts[""].shape == (32, 32)
    assert parts["_scale"].dtype == torch.float8_e4m3fn and parts["_scale"].shape == (32, 4)
    back = dequantize_nvfp4(parts[""], parts["_scale"], parts["_scale_2"])
    err = ((back - w).norm() / w.norm()).item()
    assert 0.02 < err < 0.15  # e2m1's 1 mantissa bit: ~9% rms


def test_nvfp4_checkpoint_logits_equal_its_dequantised_twin(tmp_path) -> None:
    fp4, twin = tmp_path / "fp4", tmp_path / "twin"
    subprocess.run([sys.executable, str(ROOT / "scripts/quantize_nvfp4.py"), "--random",
                    str(fp4), "--twin", str(twin), "--seed", "3"], check=True, cwd=ROOT,
                   capture_output=True)  # fmt: skip
    quant = json.loads((fp4 / "hf_quant_config.json").read_text())["quantization"]
    assert quant["quant_algo"] == "NVFP4" and quant["group_size"] == 16
    assert json.loads((fp4 / "config.json").read_text())["quantization_config"]["quant_method"]
    with safe_open(str(next(fp4.glob("*.safetensors"))), "pt") as f:
        names = set(f.keys())
        expert = "model.layers.1.mlp.experts.0.gate_proj"
        assert f.get_tensor(expert + ".weight").dtype == torch.uint8
        assert f.get_tensor(expert + ".weight_scale").dtype == torch.float8_e4m3fn
        assert f.get_tensor(expert + ".weight_scale_2").dim() == 0
        assert expert + ".input_scale" in names
        assert f.get_tensor("model.layers.1.self_attn.o_proj.weight").dtype == torch.float32
    prompt = torch.randint(0, 380, (30,), generator=torch.Generator().manual_seed(4)).tolist()
    got = score(LLM(str(fp4), dtype="float32", max_total_tokens=256, page_size=4).engine, prompt)
    want = score(LLM(str(twin), dtype="float32", max_total_tokens=256, page_size=4).engine, prompt)
    assert torch.equal(got, want)
    # and both are the transformers model holding the twin's weights
    reference = load_reference(twin)
    with torch.no_grad():
        expected = reference(torch.tensor([prompt])).logits[0]
    assert (got - expected).abs().max() / expected.abs().max() < 1e-4
