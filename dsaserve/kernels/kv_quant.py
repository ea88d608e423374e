"""The KV cache's stored forms: the compute dtype, or FP8 in FlashMLA's layout.

FP8 (`--kv-cache-dtype fp8_e4m3`), both kept as raw bytes (uint8) in the pool:

- an MLA entry is [latent as e4m3 (kv_lora_rank B) | one fp32 scale per 128 latent values
  (4 B each) | roped key k_pe in bf16 (2 B each)]: 512 + 16 + 128 = 656 B for GLM-5 / V3.2, the
  layout of FlashMLA's `is_fp8_kvcache` and vLLM's `fp8_ds_mla`. The rope part stays bf16 because
  its dot product with the query is position-sensitive and small.
- an index key is [key as e4m3 (index_head_dim B) | one fp32 scale (4 B)]: 132 B for 128 dims,
  DeepGEMM's fused `fp8_paged_mqa_logits` layout (per-token scale).

Each scale is amax / 448 (448 is e4m3's largest finite value; 1.0 for an all-zero group), so a
value's relative error is at most 2^-4 (e4m3 keeps 3 mantissa bits: half an ulp is 1/16).
Reads dequantise into the compute dtype; the Triton kernels read the bytes directly.
"""

from __future__ import annotations

import torch

from dsaserve.kernels.fp8_kv_sizes import group_size, index_key_bytes, mla_entry_bytes  # noqa: F401

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


def is_fp8(cache: torch.Tensor) -> bool:
    return cache.dtype == torch.uint8


def resolve_kv_dtype(name: str, compute: torch.dtype, device: torch.device) -> torch.dtype:
    """The pool's storage dtype: torch.uint8 for FP8 (raw bytes), else a float dtype. auto: FP8
    on Blackwell (SM 10+), else the compute dtype (Hopper and CPU), as the deployment guide says;
    bf16 / fp32 store in that dtype whatever the compute dtype."""
    if (
        name == "auto"
        and device.type == "cuda"
        and torch.cuda.get_device_capability(device)[0] >= 10
    ):
        name = "fp8_e4m3"
    stored = {"fp8_e4m3": torch.uint8, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
              "fp32": torch.float32, "float32": torch.float32}  # fmt: skip
    return stored.get(name, compute)


def kv_dtype_name(stored: torch.dtype) -> str:
    return "fp8_e4m3" if stored == torch.uint8 else str(stored).removeprefix("torch.")


def _scales(x: torch.Tensor) -> torch.Tensor:
    amax = x.abs().amax(dim=-1, keepdim=True)
    return torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))


def quantize_entry(entry: torch.Tensor, rank: int) -> torch.Tensor:
    """[..., rank + rope] float -> [..., mla_entry_bytes] uint8."""
    latent, rope = entry[..., :rank].float(), entry[..., rank:]
    grouped = latent.unflatten(-1, (-1, group_size(rank)))  # [..., G, 128]
    scale = _scales(grouped)
    q = (grouped / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8).flatten(-2)
    parts = [q.view(torch.uint8), scale.squeeze(-1).contiguous().view(torch.uint8),
             rope.to(torch.bfloat16).contiguous().view(torch.uint8)]  # fmt: skip
    return torch.cat(parts, dim=-1)


def dequantize_entry(raw: torch.Tensor, rank: int, dtype: torch.dtype) -> torch.Tensor:
    """[..., mla_entry_bytes] uint8 -> [..., rank + rope] in `dtype`."""
    groups = rank // group_size(rank)
    latent = raw[..., :rank].contiguous().view(FP8).float()
    scale = raw[..., rank : rank + 4 * groups].contiguous().view(torch.float32)
    rope = raw[..., rank + 4 * groups :].contiguous().view(torch.bfloat16)
    latent = (latent.unflatten(-1, (groups, -1)) * scale[..., None]).flatten(-2)
    return torch.cat([latent.to(dtype), rope.to(dtype)], dim=-1)


def quantize_key(key: torch.Tensor) -> torch.Tensor:
    """[..., dim] float -> [..., dim + 4] uint8 (e4m3 values, then the fp32 scale)."""
    scale = _scales(key.float())
    q = (key.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return torch.cat([q.view(torch.uint8), scale.contiguous().view(torch.uint8)], dim=-1)


def dequantize_key(raw: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    values = raw[..., :-4].contiguous().view(FP8).float()
    return (values * raw[..., -4:].contiguous().view(torch.float32)).to(dtype)


class KVStore:
    """Writes and reads of the pool, whichever form it stores (the `kv_store` op)."""

    @staticmethod
    def write_entry(cache: torch.Tensor, slots: torch.Tensor, entry: torch.Tensor, rank: int):
        value = quantize_entry(entry, rank) if is_fp8(cache) else entry.to(cache.dtype)
        cache.index_copy_(0, slots, value)

    @staticmethod
    def read_entry(cache: torch.Tensor, slots: torch.Tensor, rank: int, dtype: torch.dtype):
        """cache[slots] as [*slots.shape, rank + rope] in `dtype`."""
        rows = cache.index_select(0, slots.reshape(-1))
        rows = dequantize_entry(rows, rank, dtype) if is_fp8(cache) else rows.to(dtype)
        return rows.view(*slots.shape, rows.shape[-1])

    @staticmethod
    def write_key(cache: torch.Tensor, slots: torch.Tensor, key: torch.Tensor) -> None:
        cache.index_copy_(0, slots, quantize_key(key) if is_fp8(cache) else key.to(cache.dtype))

    @staticmethod
    def read_key(cache: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        rows = cache.index_select(0, slots.reshape(-1))
        rows = dequantize_key(rows, dtype) if is_fp8(cache) else rows.to(dtype)
        return rows.view(*slots.shape, rows.shape[-1])


KV_STORE = KVStore()
