"""`POST /v1/responses` (streamed or not), `GET` and `DELETE /v1/responses/{id}`: the chat
pipeline (template, limits, grammar, engine, reasoning and tool parsers) in the Responses envelope.

A request is translated to a chat request (`responses_items.py`), prepared by the chat route's
`prepare_chat`, run as one choice, and its parser events become output items
(`responses_events.py`). Stateless unless `store: true` (then `responses_store.py` keeps it for
`previous_response_id` and `GET`). The stream: `response.created`, `response.in_progress`, the
items' events, then `response.completed`, `response.incomplete` (cut at `max_output_tokens`) or
`response.failed` (an error after the stream started, or an abort). A client that goes away
aborts the request (as on the chat route).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError

from dsaserve.server.generation import ChatChoice, fan_in, first_outputs, unless_disconnected
from dsaserve.server.openai.protocol import ChatCompletionRequest
from dsaserve.server.openai.responses_events import EventStream, OutputItems, new_id
from dsaserve.server.openai.responses_items import request_items, to_chat_body
from dsaserve.server.openai.responses_protocol import InputItem, ResponsesRequest
from dsaserve.server.openai.serving_chat import SSE_HEADERS, Usage, prepare_chat
from dsaserve.server.state import ServerState
from dsaserve.server.tokenizer_manager import PreparedChat
from dsaserve.server.validation import validation_error
from dsaserve.web.errors import APIError, bad_request

logger = logging.getLogger("dsaserve.server")
# chat field names in errors from the shared pipeline -> the Responses field that caused them
PARAMS = (("messages", "input"), ("max_tokens", "max_output_tokens"),
          ("response_format.json_schema.schema", "text.format.schema"),
          ("response_format", "text.format"))  # fmt: skip
TERMINAL = {"completed": "response.completed", "incomplete": "response.incomplete",
            "failed": "response.failed"}  # fmt: skip


@dataclass
class Turn:
    """One response being made."""

    req: ResponsesRequest
    prepared: PreparedChat
    id: str
    model: str
    created_at: int
    choice: ChatChoice
    items: OutputItems
    usage: Usage


async def create(state: ServerState, req: ResponsesRequest, raw: Request) -> Any:
    _refuse_unsupported(state, req)
    history = _history(state, req.previous_response_id)
    prepared = await asyncio.to_thread(_prepare, state, req, history)  # keep the loop free
    tm = state.tokenizer_manager
    turn = Turn(req, prepared, new_id("resp"), req.model or tm.model_name, int(time.time()),
                ChatChoice.create(prepared, separate_reasoning=True),
                OutputItems(req.summary() is not None), Usage())  # fmt: skip
    requests = tm.make_requests(prepared.input_ids, prepared.sampling, turn.id)
    streams = await state.engine.submit(requests)
    if req.stream:
        primed = await unless_disconnected(raw, first_outputs(streams))
        body = _stream(state, turn, primed)
        return StreamingResponse(body, media_type="text/event-stream", headers=SSE_HEADERS)
    await unless_disconnected(raw, _run(turn, streams))
    response, _ = _finish(state, turn)
    return JSONResponse(response)


def retrieve(state: ServerState, response_id: str) -> dict:
    response = state.response_store.get(response_id)
    if response is None:
        raise _not_found(response_id, None)
    return response


def delete(state: ServerState, response_id: str) -> dict:
    if not state.response_store.delete(response_id):
        raise _not_found(response_id, None)
    return {"id": response_id, "object": "response", "deleted": True}


def _refuse_unsupported(state: ServerState, req: ResponsesRequest) -> None:
    refused = [
        (req.background, "background", "background responses are not supported; use stream"),
        (req.conversation is not None, "conversation", "the Conversations API is not supported; "
         "send the items, or use previous_response_id"),
        (req.prompt is not None, "prompt", "stored prompt templates are not supported"),
        (req.truncation == "auto", "truncation", "truncation 'auto' is not supported: a prompt "
         "over the context is a 400"),
        ("message.output_text.logprobs" in (req.include or []), "include",
         "message.output_text.logprobs is not supported on this route (use chat completions)"),
        (req.store and state.args.responses_store_size == 0, "store",
         "this server keeps no responses (--responses-store-size 0)"),
    ]  # fmt: skip
    for refuse, param, message in refused:
        if refuse:
            raise bad_request(message, param)


def _history(state: ServerState, previous_id: str | None) -> list[dict]:
    if previous_id is None:
        return []
    items = state.response_store.history(previous_id)
    if items is None:
        raise _not_found(previous_id, "previous_response_id")
    return items


def _not_found(response_id: str, param: str | None) -> APIError:
    what = "previous response" if param else "response"
    message = (f"{what} '{response_id[:100]}' is not stored here (only store: true responses "
               "are, in memory, at most --responses-store-size of them)")  # fmt: skip
    code = "previous_response_not_found" if param else None
    return APIError(404, message, param=param, code=code)


def _prepare(state: ServerState, req: ResponsesRequest, history: list[dict]) -> PreparedChat:
    translation = to_chat_body(req, [InputItem.model_validate(item) for item in history])
    if translation.left_out:
        kinds = ", ".join(sorted(set(translation.left_out)))
        logger.warning("/v1/responses: left out of the prompt (this server runs function "
                       "tools and renders message, reasoning and function-call items): %s",
                       kinds)  # fmt: skip
    try:
        chat = ChatCompletionRequest.model_validate(translation.body)
        return prepare_chat(state, chat)
    except ValidationError as e:
        raise _in_responses_terms(validation_error(e)) from e
    except APIError as e:
        raise _in_responses_terms(e) from e


def _in_responses_terms(error: APIError) -> APIError:
    """Name the Responses field behind an error from the chat pipeline."""
    param = error.param or ""
    for chat, ours in PARAMS:
        if param == chat or param.startswith((chat + ".", chat + "[")):
            error.param = ours if chat == "messages" else ours + param[len(chat) :]
            break
    return error


async def _run(turn: Turn, streams: list) -> None:
    async for _, output in fan_in(await first_outputs(streams)):
        turn.usage.add(output)
        turn.items.feed(turn.choice.update(output))


async def _stream(state: ServerState, turn: Turn, primed: list) -> AsyncIterator[str]:
    events = EventStream()
    for kind in ("response.created", "response.in_progress"):
        yield events.frame({"type": kind, "response": _response(state, turn, "in_progress")})
    try:
        async for _, output in fan_in(primed):
            turn.usage.add(output)
            for event in turn.items.feed(turn.choice.update(output)):
                yield events.frame(event)
        response, closing = _finish(state, turn)
    except APIError as e:
        closing = turn.items.close("incomplete")
        error = {"code": _error_code(e), "message": e.message}
        response = _response(state, turn, "failed", error=error, usage=_usage(state, turn))
    for event in closing:
        yield events.frame(event)
    yield events.frame({"type": TERMINAL[response["status"]], "response": response})


def _finish(state: ServerState, turn: Turn) -> tuple[dict, list[dict]]:
    """The final response (stored if asked) and the events that close its last item."""
    reason = turn.choice.finish_reason
    status = {"length": "incomplete", "abort": "failed"}.get(reason, "completed")
    closing = turn.items.close("completed" if status == "completed" else "incomplete")
    extra: dict[str, Any] = {"usage": _usage(state, turn)}
    if status == "incomplete":
        extra["incomplete_details"] = {"reason": "max_output_tokens"}
    elif status == "failed":
        extra["error"] = {"code": "server_error", "message": "the request was aborted"}
    else:
        extra["completed_at"] = int(time.time())
    response = _response(state, turn, status, **extra)
    if turn.req.store:
        inputs = [item.model_dump(exclude_none=True) for item in request_items(turn.req)]
        state.response_store.put(response, inputs, turn.req.previous_response_id)
    return response, closing


def _usage(state: ServerState, turn: Turn) -> dict:
    chat = turn.usage.finish([turn.choice], state.args.enable_cache_report)
    cached = chat.get("prompt_tokens_details", {}).get("cached_tokens", 0)
    return {
        "input_tokens": chat["prompt_tokens"], "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": chat["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": chat["reasoning_tokens"]},
        "total_tokens": chat["total_tokens"],
    }  # fmt: skip


def _error_code(error: APIError) -> str:
    if isinstance(error.code, str):
        return error.code
    return {429: "rate_limit_exceeded", 400: "invalid_prompt"}.get(error.status, "server_error")


def _response(state: ServerState, turn: Turn, status: str, **extra: Any) -> dict:
    """The response object as it stands (`output`: the items so far), echoing the request."""
    req, defaults = turn.req, state.tokenizer_manager.generation_defaults
    fmt = req.text.format if req.text is not None else None
    choice = req.tool_choice
    return {
        "id": turn.id, "object": "response", "created_at": turn.created_at, "status": status,
        "background": False, "error": None, "incomplete_details": None,
        "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
        "max_tool_calls": req.max_tool_calls, "model": turn.model, "output": turn.items.items,
        "parallel_tool_calls": req.parallel_tool_calls,
        "previous_response_id": req.previous_response_id,
        "reasoning": {"effort": req.reasoning.effort if req.reasoning else None,
                      "summary": req.summary()},
        "store": req.store,
        "temperature": _or(req.temperature, defaults.get("temperature"), 1.0),
        "top_p": _or(req.top_p, defaults.get("top_p"), 1.0),
        "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt
                 else {"type": "text"}},
        "tool_choice": choice.model_dump(exclude_none=True) if hasattr(choice, "model_dump")
                       else choice or "auto",
        "tools": [t.model_dump(exclude_none=True) for t in req.tools or [] if t.type == "function"],
        "truncation": "disabled", "usage": None, "metadata": req.metadata or {},
        "prompt_cache_key": req.prompt_cache_key, "user": req.user,
        "safety_identifier": req.safety_identifier,
    } | extra  # fmt: skip


def _or(*values: Any) -> Any:
    return next(v for v in values if v is not None)
