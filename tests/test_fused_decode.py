"""The fused decode path (dsaserve/engine/decode/fused.py) against the layered model, step for step.

Decode steps of a batch whose rows sit at different context lengths, below and above
index_topk, on both families (GLM with a shared-indexer layer, DeepSeek with grouped routing and
YaRN): the fused path, in Python and in its native form (kernels/cpu_decode.cpp), must give the
layered path's greedy tokens and logprobs (fp32, 1e-5), and must really have run (it is
counted), so the test fails if the engine stops using it.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from tiny_models import make_checkpoint

from dsaserve import LLM, SamplingParams
from dsaserve.engine.decode import native as cpu_decode
from dsaserve.engine.decode.fused import FusedDecode
from dsaserve.kernels.topk import topk_earliest
from dsaserve.layers.rotary import apply_rotary, rotation

MODES = {"python": {"disable_native_decode": True}, "native": {}}


class Counted:
    """The native DecodeLayers with its calls counted."""

    def __init__(self, native) -> None:
        self.native, self.calls = native, 0

    def forward(self, *args):
        self.calls += 1
        return self.native.forward(*args)


def test_native_decode_builds():
    """Where a C++ compiler is (always in CI), the extension builds: the engine must not fall
    back to the Python path there without anyone noticing."""
    if shutil.which("c++") is None and not os.environ.get("CI"):
        pytest.skip("no C++ compiler here")
    assert cpu_decode.extension() is not None


@pytest.mark.parametrize("heads,dim", [(8, 64), (32, 20), (64, 16), (5, 24)])  # vector, plain
def test_native_index_scores_read_the_pool_in_place(heads, dim):
    """The native indexer's score of key l is sum_h w_h relu(q_h . k(slots[l])), read from
    scattered pool slots, -inf where the row cannot see the key."""
    if cpu_decode.extension() is None:
        pytest.skip("the native decode extension does not build here")
    g = torch.Generator().manual_seed(1)
    q, w, pool = (
        torch.randn(heads, dim, generator=g),
        torch.randn(heads, generator=g),
        torch.randn(300, dim, generator=g),
    )
    slots = torch.randperm(300, generator=g)[:151]  # not a multiple of a block of keys
    valid = torch.rand(151, generator=g) > 0.2
    got = cpu_decode.extension().index_scores(q, w, pool, slots, valid)
    want = (w[:, None] * torch.relu(q @ pool[slots].T)).sum(0).masked_fill(~valid, float("-inf"))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_native_topk_is_topk_earliest():
    """The native top-k (one heap pass) picks what `topk_earliest` picks: on exact ties the
    earlier position, -inf (positions a row cannot see) last, positions in increasing order."""
    if cpu_decode.extension() is None:
        pytest.skip("the native decode extension does not build here")
    g = torch.Generator().manual_seed(2)
    scores = torch.randint(0, 6, (6, 500), generator=g).float()  # many exact ties
    scores[1, 300:] = float("-inf")
    scores[2, 40:] = float("-inf")  # fewer visible keys than k
    scores[3] = torch.randn(500, generator=g)
    for k in (1, 64, 499):
        got = cpu_decode.extension().topk_earliest(scores, k)
        torch.testing.assert_close(got, topk_earliest(scores, k).sort(-1).values)


CASES = [
    ("glm", 0, {"indexer_types": ["full", "shared", "full"]}),
    ("deepseek", 2, {"index_topk": 16}),
]
PROMPT_LENS = (3, 9, 40)
NEW_TOKENS = 24


@pytest.mark.parametrize("interleave", [True, False])
def test_rotation_matrix_is_apply_rotary(interleave):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(5, 4, 16, generator=generator)
    angles = torch.randn(5, 8, generator=generator)
    cos, sin = angles.cos(), angles.sin()
    rotated = torch.bmm(x, rotation(cos, sin, interleave))
    torch.testing.assert_close(rotated, apply_rotary(x, cos, sin, interleave), rtol=0, atol=1e-6)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-seed{c[1]}")
def test_fused_decode_matches_layered_model(case, mode, tmp_path, monkeypatch):
    if mode == "native" and cpu_decode.extension() is None:
        pytest.skip("the native decode extension does not build here")
    kind, seed, overrides = case
    folder = make_checkpoint(tmp_path / "ckpt", kind, seed, **overrides)
    generator = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, 380, (n,), generator=generator).tolist() for n in PROMPT_LENS]
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=2)
    calls = []
    original = FusedDecode.forward
    monkeypatch.setattr(FusedDecode, "forward", lambda self: calls.append(1) or original(self))
    results = {}
    for fused in (False, True):
        llm = LLM(str(folder), page_size=4, max_total_tokens=2048, disable_fused_decode=not fused,
                  **MODES[mode])  # fmt: skip
        step = llm.engine.runner.decode_step
        native = step.fused.native if step is not None else None
        assert (native is not None) == (fused and mode == "native")
        if native is not None:
            step.fused.native = native = Counted(native)
        results[fused] = llm.generate(prompts, params, use_tqdm=False)
        # the Python path runs FusedDecode.forward; the native one its own kept batch
        ran = native.calls if native is not None else len(calls)
        assert bool(ran) == fused
        if fused:
            assert ran >= NEW_TOKENS - 1  # every step after the prefills is an all-decode batch
    for layered, fused in zip(results[False], results[True]):
        assert fused.token_ids == layered.token_ids
        for a, b in zip(layered.logprobs, fused.logprobs):
            assert abs(a.logprob - b.logprob) < 1e-5
            assert [t for t, _ in a.top] == [t for t, _ in b.top]
            assert max(abs(x - y) for (_, x), (_, y) in zip(a.top, b.top)) < 1e-5


def test_the_decode_forms_hold_no_second_copy_of_the_weights(tmp_path):
    """The fused forms stack the attention and MLP Linears by rows (w_in, w_qres, gate_up) and
    the layered model's Linears become views of the stacks, so the engine's weights take the
    bytes of its parameters once (before: the stacks were copies beside them)."""
    folder = make_checkpoint(tmp_path / "ckpt", "glm", 0)
    with LLM(str(folder), page_size=4, max_total_tokens=1024, dtype="float32") as llm:
        model, fused = llm.engine.model, llm.engine.runner.decode_step.fused

        def storage(t: torch.Tensor) -> tuple[int, int]:
            return t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()

        params = dict(storage(p) for p in model.parameters())
        stacks = dict(storage(t) for w in fused.weights for t in (w.w_in, w.w_qres, w.mlp_gate_up))
        assert stacks.keys() <= params.keys()
        layer, weights = model.model.layers[0], fused.weights[0]
        assert storage(layer.self_attn.q_a_proj.weight) == storage(weights.w_in)
        assert torch.equal(weights.mlp_gate_up[: layer.mlp.gate_proj.weight.shape[0]],
                           layer.mlp.gate_proj.weight)  # fmt: skip
