"""Speculative-decoding counters and their reports: SGLang's accept length (tokens per verify
step, bonus included) and accept rate (correct drafts / proposed drafts), cumulative for
`Engine.stats()` and per window for the periodic decode log line."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

logger = logging.getLogger("dsaserve.engine.spec.eagle")

LOG_INTERVAL = 40  # verify steps between decode log lines


@dataclass
class SpecCounters:
    verify_ct: int = 0
    verify_tokens: int = 0  # tokens emitted by verify steps (accepted drafts + bonus)
    correct_drafts: int = 0
    proposed_drafts: int = 0

    def count_verifies(self, reqs: list, emitted: list[int], drafts: int) -> None:
        """One verify step of each of `reqs` (`drafts` proposed, `emitted[i]` tokens out), in
        these counters and in each request's own."""
        for req, tokens in zip(reqs, emitted):
            req.spec_verify_ct += 1
            req.spec_proposed_drafts += drafts
            self.verify_ct += 1
            self.proposed_drafts += drafts
            self.verify_tokens += tokens

    def add(self, other: SpecCounters) -> None:
        for name in vars(self):
            setattr(self, name, getattr(self, name) + getattr(other, name))

    @property
    def accept_length(self) -> float:
        return self.verify_tokens / self.verify_ct if self.verify_ct else 0.0

    @property
    def accept_rate(self) -> float:
        return self.correct_drafts / self.proposed_drafts if self.proposed_drafts else 0.0


class SpecReport:
    """Cumulative and windowed counters of one engine."""

    def __init__(self, num_steps: int, extra: dict | None = None) -> None:
        self.num_steps = num_steps
        self.extra = extra or {}  # fixed keys the report adds (DFlash: algorithm, block size)
        self.total = SpecCounters()
        self.window = SpecCounters()
        self.window_start = time.perf_counter()

    def add(self, step: SpecCounters) -> None:
        self.total.add(step)
        self.window.add(step)

    def log_line(self, engine_stats: Callable[[], dict]) -> None:
        """SGLang's periodic decode line, every LOG_INTERVAL verify steps."""
        if self.window.verify_ct < LOG_INTERVAL:
            return
        stats = engine_stats()
        elapsed = max(time.perf_counter() - self.window_start, 1e-9)
        logger.info(
            "Decode batch, #running-req: %d, #token: %d, accept len: %.2f, accept rate: %.2f, "
            "gen throughput (token/s): %.2f",
            stats["num_running"], stats["kv_used_tokens"], self.window.accept_length,
            self.window.accept_rate, self.window.verify_tokens / elapsed,
        )  # fmt: skip
        self.window = SpecCounters()
        self.window_start = time.perf_counter()

    def stats(self) -> dict:
        """The keys `Engine.stats()` adds (the server maps avg_spec_accept_length)."""
        return {
            "avg_spec_accept_length": self.total.accept_length,
            "spec_accept_rate": self.total.accept_rate,
            "spec_verify_ct": self.total.verify_ct,
            "spec_num_steps": self.num_steps,
            **self.extra,
        }
