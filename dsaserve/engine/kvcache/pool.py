"""The paged KV pool: per layer, each token's MLA entry and (for indexer layers) its index key.

Slots are grouped into pages of `page_size` tokens; a request owns a list of pages and its token
at position i lives in slot pages[i // page_size] * page_size + i % page_size.
"""

from __future__ import annotations

from typing import Any

import torch

from dsaserve.kernels.fp8_kv_sizes import index_key_bytes, mla_entry_bytes
from dsaserve.kernels.kv_quant import kv_dtype_name
from dsaserve.model_config import ModelConfig


def page_slots(pages: list[int], page_size: int) -> torch.Tensor:
    """Every slot of `pages`, in order: a request owning `pages` keeps token position p in slot
    [p]. The one place pages become slots (the scheduler, the pool, HiCache's moves, PD)."""
    return (torch.tensor(pages, dtype=torch.long)[:, None] * page_size
            + torch.arange(page_size)).flatten()  # fmt: skip


class PagePool:
    """Free-list allocator of page ids."""

    def __init__(self, num_pages: int) -> None:
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> list[int] | None:
        if n > len(self._free):
            return None
        taken = self._free[len(self._free) - n :]
        del self._free[len(self._free) - n :]
        return taken[::-1]

    def free(self, pages: list[int]) -> None:
        self._free.extend(reversed(pages))


class KVPool:
    def __init__(
        self,
        config: ModelConfig,
        num_pages: int,
        page_size: int,
        num_index_layers: int,
        with_mtp: bool,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        fp8: bool = False,
        split: Any = None,
    ) -> None:
        """`split(layers, main_layers, slots, dim, dtype, device)` may return a stand-in for the
        [layers, slots, entry] tensor (LayerSplit, dsaserve/layers/layer_split.py)."""
        self.page_size = page_size
        self.pages = PagePool(num_pages)
        layers = config.num_hidden_layers + int(with_mtp)
        slots = num_pages * page_size
        # FP8: raw bytes in FlashMLA's layout (kernels/kv_quant.py)
        entry, key = config.kv_entry_dim, config.index_head_dim
        if fp8:
            dtype = torch.uint8
            entry = mla_entry_bytes(config.kv_lora_rank, config.qk_rope_head_dim)
            key = index_key_bytes(key)
        stand_in = split and split(layers, config.num_hidden_layers, slots, entry, dtype, device)
        self.kv_cache = (
            stand_in
            if stand_in is not None
            else torch.zeros(layers, slots, entry, dtype=dtype, device=device)
        )
        self.index_cache = torch.zeros(num_index_layers, slots, key, dtype=dtype, device=device)

    @property
    def num_tokens(self) -> int:
        return self.pages.num_pages * self.page_size

    @staticmethod
    def bytes_per_token(
        config: ModelConfig, num_index_layers: int, with_mtp: bool, itemsize: int, fp8: bool = False
    ) -> int:
        layers = config.num_hidden_layers + int(with_mtp)
        if fp8:
            entry = mla_entry_bytes(config.kv_lora_rank, config.qk_rope_head_dim)
            return layers * entry + num_index_layers * index_key_bytes(config.index_head_dim)
        return itemsize * (layers * config.kv_entry_dim + num_index_layers * config.index_head_dim)

    @property
    def kv_dtype(self) -> str:
        """The stored form's name (--kv-cache-dtype as resolved)."""
        return kv_dtype_name(self.index_cache.dtype)

    def slots(self, pages: list[int], start: int, end: int) -> torch.Tensor:
        """Slots of token positions [start, end) for a request owning `pages`."""
        return page_slots(pages, self.page_size)[start:end]
