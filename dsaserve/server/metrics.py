"""Prometheus metrics (`/metrics`, with `--enable-metrics`), under SGLang's metric names so
existing dashboards work: TTFT, inter-token latency, end-to-end latency, token counters, aborted
and structured-output requests, cached prompt tokens by source, throughput, running/queued
requests, KV usage, cache hit rate, speculative accept length, and HiCache's per-tier hits, bytes
moved and load time (cumulative, from the engine's stats). Names, types and labels as SGLang's
`observability/metrics_collector.py` declares them."""

from __future__ import annotations

import time
from collections import deque

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily

from dsaserve.engine.messages import RequestOutput

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
THROUGHPUT_WINDOW_S = 10.0


class Metrics:
    """Request-level observations from the API process plus engine gauges at scrape time."""

    def __init__(self, model_name: str, storage_backend: str | None = None) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        r = self.registry
        self.ttft = Histogram("sglang:time_to_first_token_seconds", "Time to first token",
                              labels, buckets=LATENCY_BUCKETS, registry=r)  # fmt: skip
        self.itl = Histogram("sglang:inter_token_latency_seconds", "Inter-token latency",
                             labels, buckets=LATENCY_BUCKETS, registry=r)  # fmt: skip
        self.e2e = Histogram("sglang:e2e_request_latency_seconds", "End-to-end request latency",
                             labels, buckets=LATENCY_BUCKETS, registry=r)  # fmt: skip
        self.prompt_tokens = Counter("sglang:prompt_tokens", "Prompt tokens", labels, registry=r)
        self.gen_tokens = Counter(
            "sglang:generation_tokens", "Generated tokens", labels, registry=r
        )
        self.requests = Counter("sglang:num_requests", "Finished requests by finish reason",
                                labels + ["finish_reason"], registry=r)  # fmt: skip
        self.aborted = Counter("sglang:num_aborted_requests", "Number of requests aborted.",
                               labels, registry=r)  # fmt: skip
        self.so_requests = Counter("sglang:num_so_requests", "Number of structured output "
                                   "requests processed.", labels, registry=r)  # fmt: skip
        self.cached_tokens = CachedTokens(model_name, storage_backend)
        r.register(self.cached_tokens)
        gauges = {
            "num_running_reqs": "Running requests", "num_queue_reqs": "Queued requests",
            "token_usage": "KV cache usage (0-1)", "cache_hit_rate": "Prefix cache hit rate",
            "gen_throughput": "Generation throughput (tokens/s)",
            "spec_accept_length": "Average speculative accept length",
            "spec_accept_rate": "Speculative accept rate (correct / proposed drafts)",
        }  # fmt: skip
        self.gauges = {k: Gauge(f"sglang:{k}", h, labels, registry=r) for k, h in gauges.items()}
        self._init_hicache(labels)
        self.model = model_name
        self.started: dict[str, float] = {}
        self.cancelled: set[str] = set()  # rids the client gave up on: their abort is theirs
        self.structured: set[str] = set()  # rids sampled under a grammar
        self.last_seen: dict[str, float] = {}
        self.recent_tokens: deque[tuple[float, int]] = deque()

    def _init_hicache(self, labels: list[str]) -> None:
        r = self.registry
        tier, direction = labels + ["tier"], labels + ["direction"]
        self.hicache_hits = Gauge("sglang:hicache_hit_tokens", "Prefix tokens served per tier "
                                  "(cumulative)", tier, registry=r)  # fmt: skip
        self.hicache_bytes = Gauge("sglang:hicache_transfer_bytes", "KV bytes moved between tiers "
                                   "(cumulative)", direction, registry=r)  # fmt: skip
        self.hicache_seconds = Gauge("sglang:hicache_load_seconds", "Time loading KV to the "
                                     "device (cumulative)", tier, registry=r)  # fmt: skip
        self.hicache_host_usage = Gauge("sglang:hicache_host_token_usage", "HiCache host tier "
                                        "usage (0-1)", labels, registry=r)  # fmt: skip

    def _render_hicache(self, stats: dict) -> None:
        if "hicache_host_total_tokens" not in stats:
            return
        m = self.model
        for tier in ("device", "host", "storage"):
            self.hicache_hits.labels(m, tier).set(stats.get(f"hicache_{tier}_hit_tokens", 0))
        directions = {"device_to_host": "hicache_d2h_bytes", "host_to_device": "hicache_h2d_bytes",
                      "storage_to_device": "hicache_storage_load_bytes",
                      "host_to_storage": "hicache_storage_write_bytes"}  # fmt: skip
        for direction, key in directions.items():
            self.hicache_bytes.labels(m, direction).set(stats.get(key, 0))
        self.hicache_seconds.labels(m, "host").set(stats.get("hicache_h2d_seconds", 0.0))
        self.hicache_seconds.labels(m, "storage").set(stats.get("hicache_storage_load_seconds", 0))
        total = stats["hicache_host_total_tokens"] or 1
        self.hicache_host_usage.labels(m).set(stats.get("hicache_host_used_tokens", 0) / total)

    def on_submit(self, rid: str, structured: bool = False) -> None:
        self.started[rid] = time.monotonic()
        if structured:
            self.structured.add(rid)

    def forget(self, rid: str) -> None:
        """Drop a request's bookkeeping (finished, or rejected at admission: never ran)."""
        self.started.pop(rid, None)
        self.last_seen.pop(rid, None)
        self.cancelled.discard(rid)
        self.structured.discard(rid)

    def on_client_cancel(self, rids: list[str]) -> None:
        """The client gave up on these (it disconnected, or aborted its own rid): their abort
        counts as `client_cancel`, apart from the server's own aborts (as in sglang PR #32456,
        which reports them as 499)."""
        self.cancelled.update(rid for rid in rids if rid in self.started)

    def on_output(self, output: RequestOutput) -> None:
        now = time.monotonic()
        started = self.started.get(output.rid)
        if started is None:
            return
        tokens = len(output.token_ids)
        last = self.last_seen.get(output.rid)
        if last is None and tokens:
            self.ttft.labels(self.model).observe(now - started)
        elif last is not None and tokens:
            self.itl.labels(self.model).observe((now - last) / tokens)
        if tokens:
            self.last_seen[output.rid] = now
            self.recent_tokens.append((now, tokens))
        if output.finished:
            self._finish(output, now - started)

    def _finish(self, output: RequestOutput, elapsed: float) -> None:
        self.e2e.labels(self.model).observe(elapsed)
        self.prompt_tokens.labels(self.model).inc(output.prompt_tokens)
        self.gen_tokens.labels(self.model).inc(output.completion_tokens)
        reason = (output.finish_reason or {}).get("type", "unknown")
        if reason == "abort" and output.rid in self.cancelled:
            reason = "client_cancel"
        self.requests.labels(self.model, reason).inc()
        if reason in ("abort", "client_cancel"):
            self.aborted.labels(self.model).inc()
        if output.rid in self.structured:
            self.so_requests.labels(self.model).inc()
        self.forget(output.rid)

    def render(self, stats: dict) -> bytes:
        """The exposition text, with engine gauges refreshed from `stats`."""
        total = stats.get("kv_total_tokens") or 0
        values = {
            "num_running_reqs": stats.get("num_running", 0),
            "num_queue_reqs": stats.get("num_waiting", 0),
            "token_usage": (stats.get("kv_used_tokens", 0) / total) if total else 0.0,
            "cache_hit_rate": stats.get("cache_hit_rate", 0.0) or 0.0,
            "gen_throughput": self._throughput(),
            "spec_accept_length": stats.get("avg_spec_accept_length", 0.0) or 0.0,
            "spec_accept_rate": stats.get("spec_accept_rate", 0.0) or 0.0,
        }
        for name, value in values.items():
            self.gauges[name].labels(self.model).set(float(value))
        self._render_hicache(stats)
        self.cached_tokens.stats = stats
        return generate_latest(self.registry)

    def _throughput(self) -> float:
        cutoff = time.monotonic() - THROUGHPUT_WINDOW_S
        while self.recent_tokens and self.recent_tokens[0][0] < cutoff:
            self.recent_tokens.popleft()
        return sum(n for _, n in self.recent_tokens) / THROUGHPUT_WINDOW_S


class CachedTokens:
    """`sglang:cached_tokens_total{cache_source}`: prompt tokens served from a cache, by where
    they came from (`device`, `host`, `storage_<backend>`, SGLang's labels), from the engine's
    cumulative counters: its radix-cache hits, or with HiCache its per-tier hits."""

    def __init__(self, model_name: str, storage_backend: str | None) -> None:
        self.model = model_name
        self.storage = f"storage_{storage_backend}" if storage_backend else None
        self.stats: dict = {}

    def collect(self) -> list[CounterMetricFamily]:
        family = CounterMetricFamily("sglang:cached_tokens", "Number of cached prompt tokens by "
                                     "source (device/host/storage).",
                                     labels=["model_name", "cache_source"])  # fmt: skip
        stats = self.stats
        if "hicache_device_hit_tokens" in stats:
            sources = {"device": stats["hicache_device_hit_tokens"],
                       "host": stats.get("hicache_host_hit_tokens", 0)}  # fmt: skip
            if self.storage is not None:
                sources[self.storage] = stats.get("hicache_storage_hit_tokens", 0)
        else:
            sources = {"device": stats.get("cached_tokens", 0)}
        for source, value in sources.items():
            family.add_metric([self.model, source], float(value))
        return [family]
