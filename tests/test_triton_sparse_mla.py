"""The Triton sparse MLA decode against the torch reference, bf16/fp32 and FP8 caches."""

from __future__ import annotations

import pytest
import torch
from triton_env import DEVICE, needs_triton

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
