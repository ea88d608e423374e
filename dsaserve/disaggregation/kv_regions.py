"""What a token owns in the KV pool, as transfer segments, and per-room checksums.

A token at slot s owns, for every layer l (the MTP layer last, when loaded), the MLA entry
`kv_cache[l, s]` (normalised latent + roped key) and, for every indexer layer j, the indexer key
`index_cache[j, s]`. Slots of one page are contiguous within a layer, so a run of pages that is
consecutive on both sides moves as one segment per layer.
"""

from __future__ import annotations

import hashlib
import math

import torch

from dsaserve.engine.kvcache.pool import KVPool

Segment = tuple[int, int, int]  # (source address, destination address, length in bytes)


def describe(pool: KVPool, mtp: bool, aux: torch.Tensor) -> dict:
    """The layout a peer needs to address this side's buffers (sent at registration)."""
    kv, index = pool.kv_cache, pool.index_cache
    return {
        "kv_ptr": kv.data_ptr(), "kv_layers": kv.shape[0],
        "kv_entry_bytes": kv.shape[2] * kv.element_size(),
        "index_ptr": index.data_ptr(), "index_layers": index.shape[0],
        "index_entry_bytes": index.shape[2] * index.element_size(),
        "slots": kv.shape[1], "page_size": pool.page_size, "dtype": str(kv.dtype),
        "mtp": mtp, "aux_ptr": aux.data_ptr(), "aux_item_bytes": aux.shape[1],
        "aux_slots": aux.shape[0], "kv_kind": memory_kind(kv),
    }  # fmt: skip


POINTERS = ("kv_ptr", "index_ptr", "aux_ptr")
COUNTS = ("kv_layers", "kv_entry_bytes", "index_layers", "index_entry_bytes", "slots",
          "page_size", "aux_item_bytes", "aux_slots")  # fmt: skip


def malformed(layout: dict) -> str | None:
    """Why a peer's layout (from its registration) cannot be used as one (None when it can)."""
    for key in POINTERS + COUNTS:
        value = layout.get(key)
        low = 1 if key in ("slots", "page_size", "aux_slots") else 0
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value < 2**64:
            return f"layout field {key} is {str(value)[:40]!r}"
    if not isinstance(layout.get("dtype"), str) or not isinstance(layout.get("mtp"), bool):
        return "layout fields dtype / mtp are missing or of the wrong type"
    if layout.get("kv_kind") not in ("DRAM", "VRAM"):
        return f"layout field kv_kind is {str(layout.get('kv_kind'))[:40]!r}"
    return None


def destination_error(theirs: dict, pages: list[int], aux_index: int) -> str | None:
    """Why a room's destination does not fit the peer's pool and aux buffer (None when it does)."""
    pool_pages = theirs["slots"] // theirs["page_size"]
    if pages and max(pages) >= pool_pages:
        return f"page {max(pages)} is outside the decode's pool of {pool_pages} pages"
    if aux_index >= theirs["aux_slots"]:
        return f"aux slot {aux_index} is outside the decode's {theirs['aux_slots']} slots"
    return None


def memory_kind(tensor: torch.Tensor) -> str:
    return "VRAM" if tensor.is_cuda else "DRAM"


def regions(pool: KVPool, aux: torch.Tensor) -> list[tuple[int, int, str]]:
    """(address, bytes, memory kind) of every buffer to register with the transfer engine."""
    tensors = [pool.kv_cache, pool.index_cache, aux]
    return [(t.data_ptr(), t.numel() * t.element_size(), memory_kind(t))
            for t in tensors if t.numel()]  # fmt: skip


def mismatch(mine: dict, theirs: dict) -> str | None:
    """Why two sides cannot exchange KV (None when they can)."""
    problem = malformed(theirs)
    if problem:
        return f"the registration is malformed: {problem}"
    for key in ("kv_layers", "kv_entry_bytes", "index_layers", "index_entry_bytes", "page_size",
                "dtype", "aux_item_bytes"):  # fmt: skip
        if mine[key] != theirs[key]:
            hint = ""
            if key in ("kv_layers", "index_layers") and mine["mtp"] != theirs["mtp"]:
                hint = " (the MTP layer: give both roles the same --speculative-algorithm)"
            return f"KV layout differs: {key} {mine[key]} here, {theirs[key]} there{hint}"
    return None


def _runs(src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
    """(src page, dst page, pages) runs consecutive on both sides."""
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst):
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, d, 1))
    return runs


def kv_segments(mine: dict, theirs: dict, src: list[int], dst: list[int]) -> list[Segment]:
    """Segments writing pages `src` here to pages `dst` there, for every layer of both caches."""
    ps, segments = mine["page_size"], []
    runs = _runs(src, dst)
    for cache in ("kv", "index"):
        entry = mine[f"{cache}_entry_bytes"]
        for layer in range(mine[f"{cache}_layers"]):
            here = mine[f"{cache}_ptr"] + layer * mine["slots"] * entry
            there = theirs[f"{cache}_ptr"] + layer * theirs["slots"] * entry
            for s, d, n in runs:
                segments.append((here + s * ps * entry, there + d * ps * entry, n * ps * entry))
    return segments


def aux_segment(mine: dict, theirs: dict, src_index: int, dst_index: int) -> Segment:
    size = mine["aux_item_bytes"]
    return (mine["aux_ptr"] + src_index * size, theirs["aux_ptr"] + dst_index * size, size)


def pages_for(num_tokens: int, page_size: int) -> int:
    return math.ceil(num_tokens / page_size)


def checksums(pool: KVPool, pages: list[int], num_tokens: int) -> dict[str, list[str]]:
    """blake2b of each layer's entries (and each indexer layer's keys) of tokens [0, n)."""
    slots = pool.slots(pages, 0, num_tokens).to(pool.kv_cache.device)
    return {
        "kv": [_digest(pool.kv_cache[layer, slots]) for layer in range(pool.kv_cache.shape[0])],
        "index": [_digest(pool.index_cache[j, slots]) for j in range(pool.index_cache.shape[0])],
    }


def _digest(rows: torch.Tensor) -> str:
    data = rows.contiguous().view(torch.uint8).cpu().numpy().tobytes()
    return hashlib.blake2b(data, digest_size=8).hexdigest()
