"""The response store: `store: true` responses kept in memory, for `GET /v1/responses/{id}`,
`DELETE /v1/responses/{id}` and `previous_response_id`.

Bounded twice: at most `--responses-store-size` responses and `max_bytes` of them (their JSON
size), the least recently used dropped first. An entry keeps its own turn only (the request's
input items and the response's output items) and the id of the response it continued, so a long
conversation costs its length, not its length squared; continuing walks the links (refreshing
each), and a conversation whose earlier turn was dropped can no longer be continued. Nothing
survives a restart. Used from the event loop only, so it needs no lock.
"""

from __future__ import annotations

import json
import logging
from collections import OrderedDict
from dataclasses import dataclass

logger = logging.getLogger("dsaserve.server")
MAX_BYTES = 256 * 1024 * 1024


@dataclass
class Stored:
    response: dict
    items: list[dict]  # this turn: the input items, then the output items
    previous: str | None  # the response this one continued
    size: int


class ResponseStore:
    """An LRU map of response id -> stored response."""

    def __init__(self, max_entries: int, max_bytes: int = MAX_BYTES) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.entries: OrderedDict[str, Stored] = OrderedDict()
        self.bytes = 0

    def put(self, response: dict, input_items: list[dict], previous: str | None) -> bool:
        """Keep `response` (False if it alone is over the byte bound: then it is not kept)."""
        items = input_items + response["output"]
        size = len(json.dumps([response, input_items], ensure_ascii=False))
        if size > self.max_bytes or self.max_entries < 1:
            logger.warning("response %s not stored: %d bytes (store bound %d, %d entries)",
                           response["id"], size, self.max_bytes, self.max_entries)  # fmt: skip
            return False
        self.delete(response["id"])
        self.entries[response["id"]] = Stored(response, items, previous, size)
        self.bytes += size
        while len(self.entries) > self.max_entries or self.bytes > self.max_bytes:
            _, dropped = self.entries.popitem(last=False)
            self.bytes -= dropped.size
        return True

    def get(self, response_id: str) -> dict | None:
        entry = self._touch(response_id)
        return entry.response if entry is not None else None

    def history(self, response_id: str) -> list[dict] | None:
        """Every item of the conversation up to and including `response_id` (oldest first), or
        None if it, or a turn before it, is not stored."""
        turns: list[list[dict]] = []
        cursor: str | None = response_id
        while cursor is not None:
            entry = self._touch(cursor)
            if entry is None:
                return None
            turns.append(entry.items)
            cursor = entry.previous
        return [item for turn in reversed(turns) for item in turn]

    def delete(self, response_id: str) -> bool:
        entry = self.entries.pop(response_id, None)
        if entry is None:
            return False
        self.bytes -= entry.size
        return True

    def _touch(self, response_id: str) -> Stored | None:
        entry = self.entries.get(response_id)
        if entry is not None:
            self.entries.move_to_end(response_id)
        return entry
