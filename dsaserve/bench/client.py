"""Send one streaming request and time it: TTFT, inter-token gaps, end-to-end latency.

Every failure (HTTP status, error frame, dropped connection, bad frame, timeout) ends the request
with a reason instead of raising, so a run always finishes.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import httpx

from dsaserve.bench.backends import Backend, ChunkUpdate, RequestOptions
from dsaserve.bench.datasets import BenchRequest, TokenCounter

_MAX_ERROR_CHARS = 300


@dataclass
class RequestResult:
    """The measurements of one request. Times are seconds; `itl` has one gap per token."""

    success: bool = False
    error: str = ""
    error_kind: str = ""  # short grouping key for the failure table, e.g. "HTTP 500"
    prompt_len: int = 0
    output_len: int = 0
    cached_tokens: int | None = None
    spec_verify_ct: int | None = None
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    generated_text: str = ""


class StreamTracker:
    """Turns stream frames into token arrival times.

    A frame carrying `k` new tokens (known from cumulative usage / `meta_info` counts) adds `k`
    equal inter-token gaps, as sglang.bench_serving does; without counts each text frame is one.
    """

    def __init__(self, start: float, cumulative_text: bool) -> None:
        self.start = start
        self.cumulative_text = cumulative_text
        self.text = ""
        self.first_token_time: float | None = None
        self.last_token_time = start
        self.tokens_seen = 0
        self.last_count: int | None = None
        self.prompt_tokens: int | None = None
        self.cached_tokens: int | None = None
        self.spec_verify_ct: int | None = None
        self.finished = False
        self.itl: list[float] = []

    def on_update(self, now: float, update: ChunkUpdate) -> None:
        new_text = self._take_text(update.text)
        new_tokens = self._new_tokens(update.completion_tokens, bool(new_text))
        self._keep_counts(update)
        if new_tokens <= 0 and not new_text:
            return
        if self.first_token_time is None:
            self.first_token_time = self.last_token_time = now
        elif new_tokens > 0:
            gap = (now - self.last_token_time) / new_tokens
            self.itl.extend([gap] * new_tokens)
            self.last_token_time = now
        self.tokens_seen += new_tokens

    def _take_text(self, text: str) -> str:
        if self.cumulative_text and text.startswith(self.text):
            text = text[len(self.text) :]
        self.text += text
        return text

    def _new_tokens(self, count: int | None, has_text: bool) -> int:
        if count is None:
            return 1 if has_text else 0
        if self.last_count is None and not has_text:
            return 0  # a count-only frame after uncounted text frames (a final usage chunk)
        base = self.tokens_seen if self.last_count is None else self.last_count
        return max(count - base, 0)

    def _keep_counts(self, update: ChunkUpdate) -> None:
        for name in ("prompt_tokens", "cached_tokens", "spec_verify_ct"):
            value = getattr(update, name)
            if value is not None:
                setattr(self, name, value)
        if update.completion_tokens is not None:
            self.last_count = update.completion_tokens
        self.finished = self.finished or update.finished

    def result(self, request: BenchRequest, end: float, counter: TokenCounter) -> RequestResult:
        """The successful request's numbers; output length from the server, else counted."""
        if self.last_count is not None:
            output_len = self.last_count
        elif counter.tokenizer is not None:
            output_len = counter.count(self.text)
        else:
            output_len = self.tokens_seen
        first = self.first_token_time if self.first_token_time is not None else end
        return RequestResult(
            success=True,
            prompt_len=self.prompt_tokens if self.prompt_tokens is not None else request.prompt_len,
            output_len=output_len,
            cached_tokens=self.cached_tokens,
            spec_verify_ct=self.spec_verify_ct,
            ttft=first - self.start,
            latency=end - self.start,
            itl=self.itl,
            generated_text=self.text,
        )


def _failure(request: BenchRequest, kind: str, detail: str = "") -> RequestResult:
    message = f"{kind}: {detail}" if detail else kind
    return RequestResult(
        error=message[:_MAX_ERROR_CHARS], error_kind=kind, prompt_len=request.prompt_len
    )


async def _stream(
    client: httpx.AsyncClient,
    url: str,
    backend: Backend,
    payload: dict,
    tracker: StreamTracker,
) -> tuple[str, str] | None:
    """Read the stream into `tracker`; return (kind, detail) on failure, None on success."""
    async with client.stream("POST", url, json=payload) as response:
        if response.status_code != 200:
            body = (await response.aread()).decode("utf-8", errors="replace")
            return f"HTTP {response.status_code}", body.strip()
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[len("data:") :].strip()
            if data == "[DONE]":
                return None
            update = backend.parse(json.loads(data))
            if update.error is not None:
                return "error frame", update.error
            tracker.on_update(time.perf_counter(), update)
    if tracker.finished:
        return None  # some servers (transformers serve) end without [DONE]
    return "stream ended early", "no [DONE] and no finish_reason"


async def send_request(
    client: httpx.AsyncClient,
    base_url: str,
    backend: Backend,
    request: BenchRequest,
    options: RequestOptions,
    timeout: float,
    counter: TokenCounter,
) -> RequestResult:
    """Stream one request; never raises for server or network faults, bounded by `timeout`."""
    payload = backend.payload(request, options)
    start = time.perf_counter()
    tracker = StreamTracker(start, backend.cumulative_text)
    try:
        async with asyncio.timeout(timeout):
            failure = await _stream(client, base_url + backend.path, backend, payload, tracker)
    except TimeoutError:
        failure = (f"timeout after {timeout:g}s", "")
    except httpx.HTTPError as exc:
        failure = (type(exc).__name__, str(exc))
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError, TypeError) as exc:
        failure = ("bad frame", f"{type(exc).__name__}: {exc}")
    except Exception as exc:  # anything else still ends this request, never the run
        failure = (f"client error {type(exc).__name__}", str(exc))
    if failure is not None:
        return _failure(request, *failure)
    return tracker.result(request, time.perf_counter(), counter)
