"""The bootstrap server's table of prefill ranks: who registered, where it listens, and the layout.

A rank is keyed by (attn_dp_rank, attn_cp_rank, attn_tp_rank, pp_rank). Its first registration
gets a `registration_id` (128 random bits) in the answer; only a registration that carries that
id may replace the entry (the same process re-registering, e.g. on a new port). Anything else
for a registered rank is refused (409), so a second process cannot take a rank over. Every field
is checked: sizes and ranks in range and equal to the layout of the first registration, a port in
1..65535, a routable `rank_ip` (never a wildcard such as 0.0.0.0).
"""

from __future__ import annotations

import hmac
import re
import secrets
import threading
from typing import Any

RANK_KEYS = ("prefill_dp_rank", "prefill_cp_rank", "target_tp_rank", "target_pp_rank")
SIZES = ("attn_tp_size", "attn_cp_size", "attn_dp_size", "pp_size", "system_dp_size")
PLACES = {"attn_tp_rank": "attn_tp_size", "attn_cp_rank": "attn_cp_size",
          "attn_dp_rank": "attn_dp_size", "pp_rank": "pp_size",
          "system_dp_rank": "system_dp_size"}  # fmt: skip
LAYOUT = ("attn_tp_size", "attn_cp_size", "dp_size", "pp_size", "page_size", "kv_cache_dtype")
MAX_SIZE = 4096
MAX_EXTRA_KEYS = 16
_HOST = re.compile(r"^[A-Za-z0-9.\-:_\[\]%]{1,253}$")
WILDCARDS = ("0.0.0.0", "::", "[::]", "*")
Answer = tuple[int, "dict | str"]


class RegistrationError(ValueError):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class RankTable:
    """The registered ranks and the layout the first one announced; thread-safe."""

    def __init__(self) -> None:
        self.ranks: dict[tuple[int, int, int, int], dict] = {}
        self.ids: dict[tuple[int, int, int, int], str] = {}
        self.info: dict = {}
        self.lock = threading.Lock()

    def register(self, data: Any) -> Answer:
        try:
            key, entry, layout = _checked(data)
            with self.lock:
                return 200, self._store(key, entry, layout, data.get("registration_id"))
        except RegistrationError as e:
            return e.status, str(e)

    def _store(self, key: tuple, entry: dict, layout: dict, given: Any) -> dict:
        mismatch = [k for k in LAYOUT if self.info and self.info.get(k) != layout[k]]
        if mismatch:
            raise RegistrationError(409, f"rank {key}: {', '.join(mismatch)} differ from the "
                                    "layout registered first")  # fmt: skip
        known = self.ids.get(key)
        if known is not None and not _same_id(given, known):
            raise RegistrationError(409, f"rank {key} is already registered by another process "
                                    "(only its own registration_id may replace it)")  # fmt: skip
        if not self.info:
            self.info = {**layout, "follow_bootstrap_room": True}
        self.ranks[key] = entry
        self.ids[key] = known or secrets.token_hex(16)
        return {"registration_id": self.ids[key]}

    def ready(self) -> bool:
        info = self.info
        if not info:
            return False
        expected = info["attn_tp_size"] * info["attn_cp_size"] * info["dp_size"] * info["pp_size"]
        return len(self.ranks) >= expected

    def route(self, query: dict[str, list[str]]) -> Answer:
        try:
            ranks = tuple(_int(query[k][0], k, -1, MAX_SIZE) for k in RANK_KEYS)
        except (KeyError, IndexError, RegistrationError):
            return 400, "Missing inputs for bootstrap server."
        if not self.ready():
            return 503, f"Prefill server not fully registered yet ({len(self.ranks)} registered)."
        if ranks == (-1, -1, -1, -1):
            return 200, self.info
        with self.lock:
            found = self.ranks.get(ranks)
        return (200, found) if found else (404, f"Bootstrap info not found for {ranks}")


def _same_id(given: Any, known: str) -> bool:
    return isinstance(given, str) and hmac.compare_digest(given.encode(), known.encode())


def _checked(data: Any) -> tuple[tuple, dict, dict]:
    """(rank key, {rank_ip, rank_port}, layout) of a registration, or RegistrationError (400)."""
    if not isinstance(data, dict):
        raise RegistrationError(400, "bad registration: expected a JSON object")
    sizes = {k: _int(data.get(k, 1), k, 1, MAX_SIZE) for k in SIZES}
    places = {k: _int(data.get(k, 0), k, 0, sizes[s] - 1) for k, s in PLACES.items()}
    ip = data.get("rank_ip")
    if not isinstance(ip, str) or not _HOST.match(ip) or ip in WILDCARDS:
        raise RegistrationError(400, f"bad registration: rank_ip {str(ip)[:60]!r} is not a "
                                "routable address")  # fmt: skip
    entry = {"rank_ip": ip, "rank_port": _int(data.get("rank_port"), "rank_port", 1, 65535)}
    dtype = data.get("kv_cache_dtype")
    extra = {k: v for k, v in data.items() if k.startswith("dsaserve_")}
    scalars = all(isinstance(v, str | int | float | bool) for v in extra.values())
    if not isinstance(dtype, str | None) or len(extra) > MAX_EXTRA_KEYS or not scalars:
        raise RegistrationError(400, "bad registration: kv_cache_dtype or dsaserve_* fields")
    layout = {"attn_tp_size": sizes["attn_tp_size"], "attn_cp_size": sizes["attn_cp_size"],
              "dp_size": sizes["attn_dp_size"], "pp_size": sizes["pp_size"],
              "page_size": _int(data.get("page_size"), "page_size", 1, 1 << 20),
              "kv_cache_dtype": dtype, **extra}  # fmt: skip
    key = (places["attn_dp_rank"], places["attn_cp_rank"], places["attn_tp_rank"],
           places["pp_rank"])  # fmt: skip
    return key, entry, layout


def _int(value: Any, name: str, low: int, high: int) -> int:
    if isinstance(value, str) and re.fullmatch(r"-?[0-9]{1,12}", value):
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise RegistrationError(400, f"bad registration: {name} must be an integer in "
                                f"[{low}, {high}], got {str(value)[:40]!r}")  # fmt: skip
    return value
