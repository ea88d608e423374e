"""`/v1/messages` and `/v1/messages/count_tokens`: the chat pipeline in Anthropic's envelope.

Stream: message_start (after the first output, so usage is real), then per block
content_block_start / *_delta / content_block_stop (thinking -> text -> tool_use, text deltas only
ever to text blocks), message_delta with the stop reason, message_stop. Errors after the stream
started still end with a valid tail (error event, message_stop).
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError

from dsaserve.server.anthropic.protocol import CountTokensRequest, MessagesRequest
from dsaserve.server.anthropic.translate import to_chat_request
from dsaserve.server.generation import ChatChoice, fan_in, first_outputs, unless_disconnected
from dsaserve.server.openai.protocol import ChatCompletionRequest
from dsaserve.server.openai.serving_chat import SSE_HEADERS, prepare_chat
from dsaserve.server.parsers.chat_output import collect
from dsaserve.server.parsers.events import Content, Event, Reasoning, ToolCallArgs, ToolCallStart
from dsaserve.server.state import ServerState
from dsaserve.server.validation import validation_error
from dsaserve.web.errors import APIError


def _chat(state: ServerState, req: MessagesRequest) -> ChatCompletionRequest:
    body = to_chat_request(req, state.args.keep_anthropic_billing_header)
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as e:
        raise validation_error(e) from e


async def count_tokens(state: ServerState, req: CountTokensRequest) -> dict:
    prepared = await asyncio.to_thread(prepare_chat, state, _chat(state, req), True)
    return {"input_tokens": len(prepared.input_ids)}


async def messages(state: ServerState, req: MessagesRequest, raw: Request) -> Any:
    chat = _chat(state, req)
    prepared = await asyncio.to_thread(prepare_chat, state, chat)
    requests = state.tokenizer_manager.make_requests(prepared.input_ids, prepared.sampling, None)
    streams = await state.engine.submit(requests)
    choice = ChatChoice.create(prepared, separate_reasoning=True)
    model = req.model or state.tokenizer_manager.model_name
    msg_id = f"msg_{uuid.uuid4().hex[:24]}"
    if req.stream:
        primed = await unless_disconnected(raw, first_outputs(streams))
        body = _stream(state, primed, choice, model, msg_id)
        return StreamingResponse(body, media_type="text/event-stream", headers=SSE_HEADERS)
    usage = await unless_disconnected(raw, _run(streams, choice))
    return JSONResponse(_message(state, choice, usage, model, msg_id))


async def _run(streams: list, choice: ChatChoice) -> dict:
    last = None
    async for _, output in fan_in(await first_outputs(streams)):
        choice.update(output)
        last = output
    return {"prompt": last.prompt_tokens, "cached": last.cached_tokens}


def _usage(state: ServerState, prompt: int, cached: int, output_tokens: int) -> dict:
    cached = cached if state.args.enable_cache_report else 0
    return {"input_tokens": prompt - cached, "output_tokens": output_tokens,
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}  # fmt: skip


def stop_reason(choice: ChatChoice) -> tuple[str, str | None]:
    """Anthropic stop_reason and stop_sequence for a finished choice."""
    if choice.finish_reason == "tool_calls":
        return "tool_use", None
    if choice.finish_reason == "length":
        return "max_tokens", None
    if choice.finish_reason == "stop" and isinstance(choice.matched, str):
        return "stop_sequence", choice.matched
    return "end_turn", None


def _message(state: ServerState, choice: ChatChoice, usage: dict, model: str, msg_id: str) -> dict:
    parsed = collect(choice.events)
    content: list[dict] = []
    if parsed.reasoning:
        content.append({"type": "thinking", "thinking": parsed.reasoning, "signature": ""})
    if parsed.content:
        content.append({"type": "text", "text": parsed.content})
    for call in parsed.tool_calls:
        if choice.finish_reason == "length" and _arguments(call.arguments) is None:
            continue  # cut by max_tokens: left out (an input nobody wrote would be run)
        content.append({"type": "tool_use", "id": call.id, "name": call.name,
                        "input": _arguments(call.arguments) or {}})  # fmt: skip
    reason, sequence = stop_reason(choice)
    return {
        "id": msg_id, "type": "message", "role": "assistant", "model": model,
        "content": content, "stop_reason": reason, "stop_sequence": sequence,
        "usage": _usage(state, usage["prompt"], usage["cached"], choice.completion_tokens),
    }  # fmt: skip


def _arguments(text: str) -> dict | None:
    """The call's input, None when its arguments are not a JSON object (cut, or malformed)."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def _sse(kind: str, data: dict) -> str:
    return f"event: {kind}\ndata: {json.dumps(data | {'type': kind}, ensure_ascii=False)}\n\n"


class _Blocks:
    """The open content block and its index; opening a block of a new kind closes the old one."""

    def __init__(self) -> None:
        self.index = -1
        self.kind: str | None = None

    def open(self, kind: str, block: dict) -> list[str]:
        frames = self.close()
        self.index += 1
        self.kind = kind
        frames.append(_sse("content_block_start", {"index": self.index, "content_block": block}))
        return frames

    def close(self) -> list[str]:
        if self.kind is None:
            return []
        frames = []
        if self.kind == "thinking":
            delta = {"type": "signature_delta", "signature": ""}
            frames.append(_sse("content_block_delta", {"index": self.index, "delta": delta}))
        frames.append(_sse("content_block_stop", {"index": self.index}))
        self.kind = None
        return frames

    def delta(self, delta: dict) -> str:
        return _sse("content_block_delta", {"index": self.index, "delta": delta})

    def frames(self, event: Event) -> list[str]:
        if isinstance(event, Reasoning):
            frames = [] if self.kind == "thinking" else self.open(
                "thinking", {"type": "thinking", "thinking": "", "signature": ""}
            )  # fmt: skip
            return frames + [self.delta({"type": "thinking_delta", "thinking": event.text})]
        if isinstance(event, Content):
            frames = [] if self.kind == "text" else self.open("text", {"type": "text", "text": ""})
            return frames + [self.delta({"type": "text_delta", "text": event.text})]
        if isinstance(event, ToolCallStart):
            block = {"type": "tool_use", "id": event.id, "name": event.name, "input": {}}
            return self.open("tool_use", block)
        if isinstance(event, ToolCallArgs) and self.kind == "tool_use":
            return [self.delta({"type": "input_json_delta", "partial_json": event.fragment})]
        return []


async def _stream(
    state: ServerState, primed: list, choice: ChatChoice, model: str, msg_id: str
) -> AsyncIterator[str]:
    first = primed[0][0]
    start = {"id": msg_id, "type": "message", "role": "assistant", "model": model,
             "content": [], "stop_reason": None, "stop_sequence": None,
             "usage": _usage(state, first.prompt_tokens, first.cached_tokens, 0)}  # fmt: skip
    yield _sse("message_start", {"message": start})
    blocks = _Blocks()
    try:
        async for _, output in fan_in(primed):
            for event in choice.update(output):
                for frame in blocks.frames(event):
                    yield frame
        for frame in blocks.close():
            yield frame
        reason, sequence = stop_reason(choice)
        delta = {"stop_reason": reason, "stop_sequence": sequence}
        yield _sse(
            "message_delta", {"delta": delta, "usage": {"output_tokens": choice.completion_tokens}}
        )
    except APIError as e:
        for frame in blocks.close():
            yield frame
        yield _sse("error", e.anthropic_body())
    yield _sse("message_stop", {})
