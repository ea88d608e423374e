"""The Triton sparse MLA decode against the torch reference, bf16/fp32 and FP8 caches."""

from __future__ import annotations

import pytest
import torch
from triton_env import DEVICE, needs_triton

from dsaserve.engine.kvcache.pool import page_slots
from dsaserve.kernels import reference
from dsaserve.kernels.kv_quant import quantize_entry

pytestmark = needs_triton
RANK, ROPE = 32, 16


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("heads", [4, 20])
def test_sparse_mla_decode_matches_reference(fp8: bool, heads: int) -> None:
    from dsaserve.kernels.triton_sparse_mla import sparse_mla_decode

    g = torch.Generator().manual_seed(heads)
    entries = torch.randn(64, RANK + ROPE, generator=g)
    cache = (quantize_entry(entries, RANK) if fp8 else entries).to(DEVICE)
    q = torch.randn(3, heads, RANK + ROPE, generator=g).to(DEVICE)
    slots = torch.randint(0, 64, (3, 37), generator=g)
    allowed = torch.rand(3, 37, generator=g) < 0.6
    allowed[2] = False
    allowed[2, 5] = True  # a row with a single entry
    slots[~allowed] = -1  # FlashMLA's invalid index: never read
    slots, allowed = slots.to(DEVICE), allowed.to(DEVICE)
    got = sparse_mla_decode(q, cache, slots, allowed, RANK, 0.2)
    want = reference.sparse_mla_decode(q, cache, slots.clamp(min=0), allowed, RANK, 0.2)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def _bf16_case(heads: int, fp8: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    entries = torch.randn(96, RANK + ROPE, generator=g)
    cache = quantize_entry(entries, RANK) if fp8 else entries.bfloat16()
    q = torch.randn(2, heads, RANK + ROPE, generator=g).bfloat16()
    slots = torch.randint(0, 96, (2, 70), generator=g)
    allowed = torch.rand(2, 70, generator=g) < 0.7
    return q.to(DEVICE), cache.to(DEVICE), slots.to(DEVICE), allowed.to(DEVICE)


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("heads", [8, 64])
def test_bf16_query_runs_16_bit_dots(fp8: bool, heads: int) -> None:
    """A bf16 query: the dots run in bf16 (the probabilities rounded to bf16 before P . c, as on
    tensor cores) on the 16-head tile, and at 64 heads over a bf16 cache on the 64-head one
    (wgmma / tcgen05 on a GPU). Against the fp32 reference over the same bf16 / e4m3 values."""
    import triton.language as tl

    from dsaserve.kernels.triton_sparse_mla import sparse_mla_decode, tile

    q, cache, slots, allowed = _bf16_case(heads, fp8)
    chosen = tile(heads, q.dtype, cache.dtype, q.device)
    assert chosen.dot == tl.bfloat16 and chosen.block_h == (64 if heads == 64 and not fp8 else 16)
    got = sparse_mla_decode(q, cache, slots, allowed, RANK, 0.2)
    want = reference.sparse_mla_decode(q.float(), cache, slots, allowed, RANK, 0.2)
    assert got.dtype == torch.bfloat16
    error = ((got.float() - want).norm() / want.norm()).item()
    # bf16 rounding of P and of the output (2^-9 each), and for FP8 of the dequantised latent:
    # measured 0.002 (bf16 cache) and 0.007 (FP8)
    assert error < (2e-2 if fp8 else 1e-2), error


def test_software_e4m3_decode_is_the_hardware_one() -> None:
    """On sm_80 (no FP8 conversion) the kernel decodes the cache's e4m3 bytes with integer ops:
    the same outputs as the hardware conversion."""
    from dsaserve.kernels.gpu_target import as_target
    from dsaserve.kernels.triton_sparse_mla import sparse_mla_decode

    q, cache, slots, allowed = _bf16_case(4, fp8=True, seed=1)
    q = q.float()
    hardware = sparse_mla_decode(q, cache, slots, allowed, RANK, 0.2)
    with as_target(8, 0):
        software = sparse_mla_decode(q, cache, slots, allowed, RANK, 0.2)
    torch.testing.assert_close(software, hardware, rtol=0, atol=0)


def _paged_selection(cache_kind: str, page_size: int, heads=8, rows=2, context=300, topk=64):
    """A bf16 query (GLM-5.3's 8 heads a TP8 rank) over its row's top-k of a 300-entry context
    (> index_topk 64) kept in shuffled pages of `page_size`: the selected slots gathered from
    the page table as the layer gathers them. Entries are bf16 values (what a bf16 engine
    writes, also into an fp32 cache)."""
    g = torch.Generator().manual_seed(page_size)
    pages = -(-context // page_size)
    entries = torch.randn(rows * pages * page_size, RANK + ROPE, generator=g).bfloat16().float()
    cache = {"bf16": entries.bfloat16(), "fp8": quantize_entry(entries, RANK),
             "fp32": entries}[cache_kind]  # fmt: skip
    order = torch.randperm(rows * pages, generator=g).view(rows, pages)
    table = torch.stack([page_slots(row.tolist(), page_size)[:context] for row in order])
    valid = torch.arange(context)[None, :] < torch.tensor([context, context - 50])[:, None]
    picks = torch.stack([torch.randperm(context - 50, generator=g)[:topk].sort().values
                         for _ in range(rows)])  # fmt: skip
    q = torch.randn(rows, heads, RANK + ROPE, generator=g).bfloat16()
    slots, allowed = table.gather(1, picks), valid.gather(1, picks)
    return q.to(DEVICE), cache.to(DEVICE), slots.to(DEVICE), allowed.to(DEVICE)


@pytest.mark.parametrize("page_size", [1, 64])
@pytest.mark.parametrize("cache_kind", ["bf16", "fp8", "fp32"])
def test_top_k_of_a_paged_context(cache_kind: str, page_size: int) -> None:
    """bf16 dots over every cache (an fp32 one converted to bf16 in registers, as the reference
    reads it): within the bf16 bound of the fp32 reference over the same values."""
    import triton.language as tl

    from dsaserve.kernels.triton_sparse_mla import sparse_mla_decode, tile

    q, cache, slots, allowed = _paged_selection(cache_kind, page_size)
    assert tile(8, q.dtype, cache.dtype, q.device).dot == tl.bfloat16
    got = sparse_mla_decode(q, cache, slots, allowed, RANK, 0.2)
    want = reference.sparse_mla_decode(q.float(), cache, slots, allowed, RANK, 0.2)
    error = ((got.float() - want).norm() / want.norm()).item()
    assert error < (2e-2 if cache_kind == "fp8" else 1e-2), error
