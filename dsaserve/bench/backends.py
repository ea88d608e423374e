"""Wire formats of the benchmarked APIs: one request payload and one stream-chunk parser each.

Supported: OpenAI `/v1/chat/completions`, OpenAI `/v1/completions`, and SGLang's native
`/generate` (streams `data: {"text", "meta_info"}` frames with cumulative text, then
`data: [DONE]`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

from dsaserve.bench.datasets import BenchRequest


class ChunkUpdate(NamedTuple):
    """What one streamed frame says. Token counts are cumulative; None means "not reported"."""

    text: str = ""
    completion_tokens: int | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    spec_verify_ct: int | None = None
    finished: bool = False
    error: str | None = None


@dataclass(frozen=True)
class RequestOptions:
    """Per-run request settings shared by every backend."""

    model: str | None
    ignore_eos: bool = True
    extra_body: dict[str, Any] = field(default_factory=dict)


class Backend:
    """One API flavour: where to POST, what to send, how to read each streamed JSON frame."""

    name = ""
    path = ""
    cumulative_text = False  # True when each frame repeats the whole text so far

    def payload(self, request: BenchRequest, options: RequestOptions) -> dict[str, Any]:
        raise NotImplementedError

    def parse(self, frame: dict[str, Any]) -> ChunkUpdate:
        raise NotImplementedError


def _usage_update(frame: dict[str, Any], text: str, finished: bool) -> ChunkUpdate:
    usage = frame.get("usage") or {}
    details = usage.get("prompt_tokens_details") or {}
    return ChunkUpdate(
        text=text,
        completion_tokens=usage.get("completion_tokens"),
        prompt_tokens=usage.get("prompt_tokens"),
        cached_tokens=details.get("cached_tokens"),
        finished=finished,
        error=_frame_error(frame),
    )


def _frame_error(frame: dict[str, Any]) -> str | None:
    error = frame.get("error")
    if error is None:
        return None
    if isinstance(error, dict):
        return str(error.get("message") or error)
    return str(error)


def _openai_payload(request: BenchRequest, options: RequestOptions) -> dict[str, Any]:
    payload: dict[str, Any] = {
        "model": options.model,
        "temperature": 0.0,
        "max_tokens": request.output_len,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    if options.ignore_eos:
        payload["ignore_eos"] = True
    return payload


class OpenAIChat(Backend):
    """`POST /v1/chat/completions` with one user message."""

    name = "openai-chat"
    path = "/v1/chat/completions"

    def payload(self, request: BenchRequest, options: RequestOptions) -> dict[str, Any]:
        payload = _openai_payload(request, options)
        payload["messages"] = [{"role": "user", "content": request.prompt}]
        return {**payload, **options.extra_body}

    def parse(self, frame: dict[str, Any]) -> ChunkUpdate:
        choice = (frame.get("choices") or [{}])[0]
        delta = choice.get("delta") or {}
        text = (delta.get("reasoning_content") or "") + (delta.get("content") or "")
        for call in delta.get("tool_calls") or []:
            text += (call.get("function") or {}).get("arguments") or ""
        return _usage_update(frame, text, bool(choice.get("finish_reason")))


class OpenAICompletions(Backend):
    """`POST /v1/completions` with a text prompt."""

    name = "openai-completions"
    path = "/v1/completions"

    def payload(self, request: BenchRequest, options: RequestOptions) -> dict[str, Any]:
        payload = _openai_payload(request, options)
        payload["prompt"] = request.prompt
        return {**payload, **options.extra_body}

    def parse(self, frame: dict[str, Any]) -> ChunkUpdate:
        choice = (frame.get("choices") or [{}])[0]
        return _usage_update(frame, choice.get("text") or "", bool(choice.get("finish_reason")))


class SGLangGenerate(Backend):
    """SGLang's native `POST /generate`; each frame carries the whole text so far."""

    name = "generate"
    path = "/generate"
    cumulative_text = True

    def payload(self, request: BenchRequest, options: RequestOptions) -> dict[str, Any]:
        sampling = {"temperature": 0.0, "max_new_tokens": request.output_len}
        if options.ignore_eos:
            sampling["ignore_eos"] = True
        extra = dict(options.extra_body)
        sampling.update(extra.pop("sampling_params", {}))
        return {"text": request.prompt, "sampling_params": sampling, "stream": True, **extra}

    def parse(self, frame: dict[str, Any]) -> ChunkUpdate:
        meta = frame.get("meta_info") or {}
        return ChunkUpdate(
            text=frame.get("text") or "",
            completion_tokens=meta.get("completion_tokens"),
            prompt_tokens=meta.get("prompt_tokens"),
            cached_tokens=meta.get("cached_tokens"),
            spec_verify_ct=meta.get("spec_verify_ct"),
            finished=bool(meta.get("finish_reason")),
            error=_frame_error(frame),
        )


BACKENDS: dict[str, type[Backend]] = {
    cls.name: cls for cls in (OpenAIChat, OpenAICompletions, SGLangGenerate)
}
