"""FlashMLA behind the `sparse_mla` seam (`--dsa-decode-backend flashmla_sparse | flashmla_kv |
flashmla_auto`): the sparse FP8 decode kernel over the pool's 656-byte entries, as is.

NEVER RUN on a GPU: no machine with FlashMLA was available to this build. Importing this module
imports `flash_mla` (PyPI `sgl-flash-mla`, the legacy V3.2 interface); where that fails the
registry falls back to our Triton kernel (CUDA) or refuses the flag (CPU). What is checked, on
CPU (tests/test_kernel_adapters.py), is the plumbing: with a stand-in `flash_mla` module that
computes the documented contract in torch, the adapter gives the reference's attention.

The call: `get_mla_metadata(cache_seqlens, s_q * h_q // h_k, h_k, h_q, is_fp8_kvcache, topk)`
then `flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, head_dim_v, metadata,
num_splits, softmax_scale, causal, is_fp8_kvcache, indices)` with q [B, 1, H, 576] bf16 (H
padded to 64 / 128), k_cache [blocks, 64, 1, 656] uint8 (kernels/kv_quant.py's entry is that
layout: 512 e4m3 + 4 fp32 scales + 64 bf16 rope), indices [B, 1, topk] int32 token ids into
the flattened cache (-1: skipped), no block table. Other caches (bf16 / fp32, a pool not a
multiple of 64 slots, a latent other than 512) run the Triton kernel.
"""

from __future__ import annotations

import flash_mla
import torch
import torch.nn.functional as F

from dsaserve.kernels import triton_sparse_mla

PAGE = 64  # FlashMLA's page block
ENTRY_BYTES = 656
RANK = 512


def _padded_heads(heads: int) -> int:
    return 64 if heads <= 64 else -(-heads // 128) * 128


def supported(q: torch.Tensor, cache: torch.Tensor, rank: int) -> bool:
    return (cache.dtype == torch.uint8 and cache.shape[-1] == ENTRY_BYTES and rank == RANK
            and cache.shape[0] % PAGE == 0 and q.shape[-1] == RANK + 64)  # fmt: skip


def sparse_mla_decode(q, cache, slots, allowed, rank: int, scale: float) -> torch.Tensor:
    """q [B, H, 576] over the FP8 entries `slots` [B, L] where `allowed`: [B, H, 512]."""
    if not supported(q, cache, rank) or q.shape[0] == 0:
        return triton_sparse_mla.sparse_mla_decode(q, cache, slots, allowed, rank, scale)
    batch, heads, _ = q.shape
    padded = _padded_heads(heads)
    q4 = F.pad(q.to(torch.bfloat16), (0, 0, 0, padded - heads))[:, None]  # [B, 1, Hp, 576]
    k_cache = cache.view(-1, PAGE, 1, ENTRY_BYTES)
    indices = slots.masked_fill(~allowed, -1).to(torch.int32)[:, None]  # [B, 1, L]
    topk = indices.shape[-1]
    seqlens = torch.full((batch,), topk, dtype=torch.int32, device=q.device)
    metadata, num_splits = flash_mla.get_mla_metadata(seqlens, padded, 1, padded, True, topk)
    out, _ = flash_mla.flash_mla_with_kvcache(q4, k_cache, None, None, rank, metadata, num_splits,
                                              scale, False, True, indices)  # fmt: skip
    return out[:, 0, :heads].to(q.dtype)
