"""NVFP4 checkpoints decode natively with their routed experts kept 4-bit (layers/nvfp4_experts.py,
kernels/cpu_decode_math.h), against the checkpoint's dequantised twin.

- kept: on CPU (`auto`, one rank) every MoE layer's experts hold the checkpoint's e2m1 bytes and
  e4m3 scales as stored (plus one fp32 global scale a row), not a float copy; an explicit
  `--moe-runner-backend torch` dequantises them on load as before;
- the same answers: greedy tokens and every step's logprob (and top-2) equal the twin's on the
  layered path within 1e-5 in fp32, requests past `index_topk` decoding together (each weight is
  made as e2m1 * (scale * scale_2) in fp32, the loader's dequantisation, so the bound is the sum
  order only), and the kept layered path (prefill, one busy expert dequantised at a time) scores
  as the twin.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from engine_score import score
from safetensors import safe_open
from test_fused_decode import Counted
from test_native_decode import PARAMS, assert_close, prompts_of

from dsaserve import LLM
from dsaserve.engine.decode import native as cpu_decode
from dsaserve.layers.moe import Experts, MoE
from dsaserve.layers.nvfp4_experts import Nvfp4Experts

pytestmark = pytest.mark.skipif(
    cpu_decode.extension() is None, reason="the native decode extension does not build here"
)

ROOT = Path(__file__).resolve().parents[1]
COMMON = dict(dtype="float32", page_size=4, max_total_tokens=4096)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("nvfp4")
    subprocess.run([sys.executable, str(ROOT / "scripts/quantize_nvfp4.py"), "--random",
                    str(root / "fp4"), "--twin", str(root / "twin"), "--seed", "5"], check=True,
                   cwd=ROOT, capture_output=True)  # fmt: skip
    return root / "fp4", root / "twin"


def test_experts_stay_nvfp4_as_stored(folders):
    fp4, _ = folders
    model = LLM(str(fp4), **COMMON).engine.model
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    assert moes and all(isinstance(m.experts, Nvfp4Experts) for m in moes)
    experts = moes[0].experts
    assert experts.gate_up_proj.dtype == torch.uint8
    inner = experts.down_proj.shape[-1] * 2
    name = "model.layers.1.mlp.experts.3.up_proj.weight"
    with safe_open(str(next(fp4.glob("*.safetensors"))), "pt") as f:
        codes, scale = f.get_tensor(name), f.get_tensor(name + "_scale")
        scale_2 = f.get_tensor(name + "_scale_2")
    assert torch.equal(experts.gate_up_proj[3, inner:], codes)
    assert torch.equal(experts.gate_up_proj_scale[3, inner:].view(torch.uint8),
                       scale.view(torch.uint8))  # fmt: skip
    assert torch.equal(experts.gate_up_proj_scale_2[3, inner:, 0], scale_2.float().expand(inner))
    dequantised = LLM(str(fp4), moe_runner_backend="torch", **COMMON).engine.model
    assert all(type(m.experts) is Experts and m.experts.down_proj.dtype == torch.float32
               for m in dequantised.modules() if isinstance(m, MoE))  # fmt: skip


def test_native_nvfp4_gives_the_twins_answers(folders):
    fp4, twin = folders
    prompts = prompts_of((30, 9, 50, 41), seed=3)
    reference = LLM(str(twin), disable_fused_decode=True, **COMMON)
    want = reference.generate(prompts, PARAMS, use_tqdm=False)
    llm = LLM(str(fp4), **COMMON)
    step = llm.engine.runner.decode_step
    assert step is not None and step.native is not None
    step.fused.native = counted = Counted(step.native)
    got = llm.generate(prompts, PARAMS, use_tqdm=False)
    assert counted.calls > 0
    assert_close(want, got)
    kept, expected = score(llm.engine, prompts[2]), score(reference.engine, prompts[2])
    assert (kept - expected).abs().max() / expected.abs().max() < 1e-5
