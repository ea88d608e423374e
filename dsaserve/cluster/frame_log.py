"""Frames from another process that could not be used: counted by kind, logged sparingly.

The first drop of each kind is logged at once (with the reason); later ones of that kind at most
once per `interval` seconds, with how many were dropped since. Nothing is raised: a bad frame is
dropped, or fails only the room it names, and the engine goes on.
"""

from __future__ import annotations

import logging
import time

LOG_INTERVAL_S = 60.0


class FrameLog:
    def __init__(self, logger: logging.Logger, source: str, interval: float = LOG_INTERVAL_S):
        self.logger, self.source, self.interval = logger, source, interval
        self.counts: dict[str, int] = {}
        self._logged: dict[str, tuple[float, int]] = {}  # kind -> (when, count then)

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def dropped(self, kind: str, reason: str, exc_info: bool = False) -> None:
        count = self.counts[kind] = self.counts.get(kind, 0) + 1
        now = time.monotonic()
        when, before = self._logged.get(kind, (None, 0))
        if when is not None and now - when < self.interval:
            return
        self._logged[kind] = (now, count)
        since = f" ({count - before} since the last report)" if when is not None else ""
        self.logger.warning("dropped a frame from %s (%s): %s%s", self.source, kind, reason[:300],
                            since, exc_info=exc_info)  # fmt: skip
