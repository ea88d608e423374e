"""The Triton indexer against the torch reference (interpreter on CPU, the GPU under CUDA)."""

from __future__ import annotations

import pytest
import torch
from triton_env import DEVICE, needs_triton

from dsaserve.kernels import reference
from dsaserve.kernels.kv_quant import quantize_key

pytestmark = needs_triton


def _case(fp8: bool, b=3, h=4, d=32, length=40, slots=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(slots, d, generator=g)
    cache = quantize_key(keys) if fp8 else keys
    q = torch.randn(b, h, d, generator=g)
    weights = torch.randn(b, h, generator=g)
    table = torch.randint(0, slots, (b, length), generator=g)
    valid = torch.arange(length)[None, :] < torch.tensor([length, 25, 7][:b])[:, None]
    return [t.to(DEVICE) for t in (q, weights, cache, table, valid)]


@pytest.mark.parametrize("fp8", [False, True])
def test_scores_and_topk_match_reference(fp8: bool) -> None:
    from dsaserve.kernels import triton_indexer

    q, w, cache, table, valid = _case(fp8)
    got = triton_indexer.indexer_scores(q, w, cache, table, valid)
    keys = reference.KV_STORE.read_key(cache, table, torch.float32)
    want = reference.indexer_scores(q, w, keys, valid)
    assert torch.equal(got.isinf(), want.isinf())
    finite = want.isfinite()
    torch.testing.assert_close(got[finite], want[finite], rtol=1e-4, atol=1e-4)
    picks = triton_indexer.indexer_decode_topk(q, w, cache, table, valid, 8)
    assert torch.equal(picks, reference.indexer_decode_topk(q, w, cache, table, valid, 8))


def test_ties_go_to_the_earlier_position() -> None:
    """Zero keys score exactly 0.0 under every head: of the tied positions the earliest win."""
    from dsaserve.kernels import triton_indexer

    q, w, _, _, valid = _case(False)
    w = w.abs() + 0.1
    table = torch.stack([torch.randperm(64)[:40] for _ in range(3)]).to(DEVICE)
    cache = torch.zeros(64, 32, device=DEVICE)
    cache[table[0, 20]] = q[0].sum(0)  # one key that scores > 0 for row 0
    picks = triton_indexer.indexer_decode_topk(q, w, cache, table, valid, 6)
    assert picks[0].tolist() == [0, 1, 2, 3, 4, 20]
    assert picks[2].tolist()[:6] == [0, 1, 2, 3, 4, 5]  # row 2: 7 valid, all tied at 0
    assert torch.equal(picks, reference.indexer_decode_topk(q, w, cache, table, valid, 6))


@pytest.mark.parametrize("fp8", [False, True])
def test_64_heads_of_128_dims(fp8: bool) -> None:
    """DeepSeek-V3.2's indexer (64 heads x 128): the key in 32-wide chunks chained through one
    accumulator, against the reference, and the same top-k."""
    from dsaserve.kernels import triton_indexer

    q, w, cache, table, valid = _case(fp8, b=2, h=64, d=128, length=70, slots=96, seed=1)
    got = triton_indexer.indexer_scores(q, w, cache, table, valid)
    want = reference.indexer_scores(q, w, reference.KV_STORE.read_key(cache, table, torch.float32),
                                    valid)  # fmt: skip
    finite = want.isfinite()
    assert torch.equal(got.isfinite(), finite)
    torch.testing.assert_close(got[finite], want[finite], rtol=1e-4, atol=1e-4)
    picks = triton_indexer.indexer_decode_topk(q, w, cache, table, valid, 16)
    assert torch.equal(picks, reference.indexer_decode_topk(q, w, cache, table, valid, 16))


def test_software_e4m3_keys_score_as_the_hardware_ones() -> None:
    from dsaserve.kernels import triton_indexer
    from dsaserve.kernels.gpu_target import as_target

    q, w, cache, table, valid = _case(True, seed=2)
    hardware = triton_indexer.indexer_scores(q, w, cache, table, valid)
    with as_target(8, 0):  # A100: the bytes decoded with integer ops
        software = triton_indexer.indexer_scores(q, w, cache, table, valid)
    assert torch.equal(software, hardware)
