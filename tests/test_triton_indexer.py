"""The Triton indexer against the torch reference (interpreter on CPU, the GPU under CUDA).

A bf16 query runs the tensor-core form (bf16 dots, FP8 keys widened and their scales on the
accumulator), an fp32 one the IEEE fp32 form; both are held to `score_bound` (the reference's
scores up to the order of fp32 additions), and their top-k to the reference's wherever the
scores at the cut differ by more than that bound."""

from __future__ import annotations

import pytest
import torch
from triton_env import DEVICE, needs_triton

from dsaserve.engine.kvcache.pool import page_slots
from dsaserve.kernels import reference
from dsaserve.kernels.kv_quant import KV_STORE, quantize_key

pytestmark = needs_triton
CACHES = ("bf16", "fp8", "fp32")


def _paged_case(cache_kind: str, page_size: int, b=2, h=32, d=128, length=300, seed=0):
    """GLM-5.3's indexer shape (32 heads x 128) over a pool of pages: each row's context lives
    in shuffled pages of `page_size`; keys are bf16 values (what a bf16 engine writes, also into
    an fp32 cache). A bf16 query, weights with the scales folded in."""
    g = torch.Generator().manual_seed(seed + page_size)
    pages = -(-length // page_size)
    keys = torch.randn(b * pages * page_size, d, generator=g).bfloat16().float()
    cache = {"bf16": keys.bfloat16(), "fp8": quantize_key(keys), "fp32": keys}[cache_kind]
    order = torch.randperm(b * pages, generator=g).view(b, pages)
    table = torch.stack([page_slots(row.tolist(), page_size)[:length] for row in order])
    q = torch.randn(b, h, d, generator=g).bfloat16()
    weights = torch.randn(b, h, generator=g) * (h * d) ** -0.5
    valid = torch.arange(length)[None, :] < torch.tensor([length, length - 37][:b])[:, None]
    return [t.to(DEVICE) for t in (q, weights, cache, table, valid)]


def _assert_same_selection(got, want, scores, bound) -> None:
    """The picks [B, k] equal the reference's, except that positions whose reference scores lie
    within twice the bound of the k-th may trade places."""
    for row in range(got.shape[0]):
        ours, theirs = set(got[row].tolist()), set(want[row].tolist())
        kth = scores[row, want[row]].min()
        for position in ours ^ theirs:
            assert abs(scores[row, position] - kth) <= 2 * bound[row].max(), (row, position)


@pytest.mark.parametrize("page_size", [1, 64])
@pytest.mark.parametrize("cache_kind", CACHES)
def test_tensor_core_scores_and_topk_within_the_bound(cache_kind: str, page_size: int) -> None:
    """Context 300 > index_topk 64, pages of 1 and 64 tokens: the scores within `score_bound`
    of the reference's, and the same top-k."""
    from dsaserve.kernels import triton_indexer

    q, w, cache, table, valid = _paged_case(cache_kind, page_size)
    want, bound = _assert_scores_within_bound(q, w, cache, table, valid)
    picks = triton_indexer.indexer_decode_topk(q, w, cache, table, valid, 64)
    want_picks = reference.indexer_decode_topk(q, w, cache, table, valid, 64)
    _assert_same_selection(picks, want_picks, want, bound)
    assert torch.equal(picks, want_picks)  # no near-tie at the cut in these draws


def _assert_scores_within_bound(q, w, cache, table, valid):
    """The kernel's scores: -inf where the reference's are, else within `score_bound` of them.
    Returns (reference scores, bound)."""
    from dsaserve.kernels import triton_indexer

    got = triton_indexer.indexer_scores(q, w, cache, table, valid)
    keys = KV_STORE.read_key(cache, table, torch.float32)
    want = reference.indexer_scores(q, w, keys, valid)
    assert torch.equal(got.isinf(), want.isinf())
    finite = want.isfinite()
    bound = triton_indexer.score_bound(q, w, keys)
    assert ((got - want).abs()[finite] <= bound[finite]).all()
    return want, bound


def test_a_program_walks_several_blocks(monkeypatch) -> None:
    """Fewer programs than blocks (long contexts): each walks `steps` blocks, the last one cut
    short at the context's end; the same scores as one block a program."""
    from dsaserve.kernels import triton_indexer

    q, w, cache, table, valid = _paged_case("fp8", 64, length=330, seed=3)
    one_each = triton_indexer.indexer_scores(q, w, cache, table, valid)
    monkeypatch.setattr(triton_indexer, "TARGET_PROGRAMS", 4)
    assert triton_indexer.steps(2, 330) == 3
    walked = triton_indexer.indexer_scores(q, w, cache, table, valid)
    assert torch.equal(walked, one_each)


def _case(fp8: bool, b=3, h=4, d=32, length=40, slots=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(slots, d, generator=g).bfloat16().float()  # as a bf16 engine writes them
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
    _assert_scores_within_bound(q, w, cache, table, valid)
    picks = triton_indexer.indexer_decode_topk(q, w, cache, table, valid, 8)
    assert torch.equal(picks, reference.indexer_decode_topk(q, w, cache, table, valid, 8))


@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
def test_ties_go_to_the_earlier_position(q_dtype: torch.dtype) -> None:
    """Zero keys score exactly 0.0 under every head (on tensor cores too): of the tied
    positions the earliest win."""
    from dsaserve.kernels import triton_indexer

    q, w, _, _, valid = _case(False)
    q, w = q.to(q_dtype), w.abs() + 0.1
    table = torch.stack([torch.randperm(64)[:40] for _ in range(3)]).to(DEVICE)
    cache = torch.zeros(64, 32, device=DEVICE)
    cache[table[0, 20]] = q[0].float().sum(0)  # one key that scores > 0 for row 0
    picks = triton_indexer.indexer_decode_topk(q, w, cache, table, valid, 6)
    assert picks[0].tolist() == [0, 1, 2, 3, 4, 20]
    assert picks[2].tolist()[:6] == [0, 1, 2, 3, 4, 5]  # row 2: 7 valid, all tied at 0
    assert torch.equal(picks, reference.indexer_decode_topk(q, w, cache, table, valid, 6))


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
def test_64_heads_of_128_dims(fp8: bool, q_dtype: torch.dtype) -> None:
    """DeepSeek-V3.2's indexer (64 heads x 128): fp32, the key in 32-wide chunks chained
    through one accumulator; bf16, one tensor-core dot with the heads as its N. Against the
    reference, and the same top-k."""
    from dsaserve.kernels import triton_indexer

    q, w, cache, table, valid = _case(fp8, b=2, h=64, d=128, length=70, slots=96, seed=1)
    q = q.to(q_dtype)
    got = triton_indexer.indexer_scores(q, w, cache, table, valid)
    want = reference.indexer_scores(q, w, reference.KV_STORE.read_key(cache, table, torch.float32),
                                    valid)  # fmt: skip
    finite = want.isfinite()
    assert torch.equal(got.isfinite(), finite)
    torch.testing.assert_close(got[finite], want[finite], rtol=1e-4, atol=1e-4)
    picks = triton_indexer.indexer_decode_topk(q, w, cache, table, valid, 16)
    assert torch.equal(picks, reference.indexer_decode_topk(q, w, cache, table, valid, 16))


@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
def test_software_e4m3_keys_score_as_the_hardware_ones(q_dtype: torch.dtype) -> None:
    from dsaserve.kernels import triton_indexer
    from dsaserve.kernels.gpu_target import as_target

    q, w, cache, table, valid = _case(True, seed=2)
    q = q.to(q_dtype)
    hardware = triton_indexer.indexer_scores(q, w, cache, table, valid)
    with as_target(8, 0):  # A100: the bytes decoded with integer ops
        software = triton_indexer.indexer_scores(q, w, cache, table, valid)
    assert torch.equal(software, hardware)
