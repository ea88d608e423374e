"""`/v1/chat/completions`: prepare (template, limits, sampling), run, and answer in OpenAI's shape.

Streaming order per choice: a role chunk, reasoning/content/tool-call deltas, then the finish in
its own chunk (field report A14); with `stream_options.include_usage` a usage chunk; `[DONE]`.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from dsaserve.disaggregation.request_fields import attach_bootstrap
from dsaserve.server.generation import ChatChoice, fan_in, first_outputs, unless_disconnected
from dsaserve.server.openai.protocol import ChatCompletionRequest
from dsaserve.server.parsers.chat_output import collect
from dsaserve.server.parsers.events import Content, Event, Reasoning, ToolCallArgs, ToolCallStart
from dsaserve.server.state import ServerState
from dsaserve.server.tokenizer_manager import PreparedChat, normalize_messages
from dsaserve.web.errors import APIError, bad_request

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def prepare_chat(
    state: ServerState, req: ChatCompletionRequest, count_only: bool = False
) -> PreparedChat:
    """Template, tokenize, check limits, build sampling (`count_only`: any length, no limits)."""
    tm = state.tokenizer_manager
    tools = [t.model_dump(exclude_none=True) for t in req.tools or []]
    tool_choice = req.tool_choice
    if hasattr(tool_choice, "model_dump"):
        tool_choice = tool_choice.model_dump()
        names = {t["function"]["name"] for t in tools}
        if tool_choice["function"]["name"] not in names:
            raise bad_request("tool_choice names a function that is not in tools", "tool_choice")
    if tool_choice == "required" and not tools:
        raise bad_request("tool_choice 'required' needs tools", "tool_choice")
    kwargs = tm.template_kwargs(req.chat_template_kwargs, req.reasoning_effort)
    prompt = tm.render_chat(normalize_messages(req.messages), tools, kwargs)
    input_ids = tm.encode(prompt)
    max_tokens = req.max_completion_tokens if req.max_tokens is None else req.max_tokens
    param = "max_tokens" if req.max_tokens is not None else "max_completion_tokens"
    fields = req.model_dump()
    fields["logprobs"] = (req.top_logprobs or 0) if req.logprobs else None
    parsing = tm.reasoning_parser is not None or (tm.tool_parser is not None and bool(tools))
    if parsing:
        fields["skip_special_tokens"] = False  # the parsers need the markup tokens
    if count_only:
        max_tokens = max_tokens or 1
    else:
        fields.update(tm.structured.chat_fields(req, tools, tool_choice, tm.tool_parser, prompt,
                                                tm.reasoning_parser))  # fmt: skip
        max_tokens = tm.fit_max_tokens(len(input_ids), max_tokens, param)
    sampling = tm.sampling(fields, max_tokens)
    return PreparedChat(
        prompt=prompt, input_ids=input_ids, sampling=sampling,
        force_reasoning=prompt.rstrip().endswith("<think>"),
        reasoning_parser=tm.reasoning_parser, tool_parser=tm.tool_parser,
        tools=tools, tool_choice=tool_choice,
    )  # fmt: skip


async def chat_completions(state: ServerState, req: ChatCompletionRequest, raw: Request) -> Any:
    prepared = await asyncio.to_thread(prepare_chat, state, req)  # keep the HTTP loop free
    requests = state.tokenizer_manager.make_requests(prepared.input_ids, prepared.sampling, req.rid)
    attach_bootstrap(state.args, req, requests)
    streams = await state.engine.submit(requests)
    choices = [ChatChoice.create(prepared, req.separate_reasoning) for _ in requests]
    model = req.model or state.tokenizer_manager.model_name
    response_id = f"chatcmpl-{requests[0].rid.rsplit('-', 1)[0]}"
    if req.stream:
        primed = await unless_disconnected(raw, first_outputs(streams))
        body = _stream(state, req, primed, choices, model, response_id)
        return StreamingResponse(body, media_type="text/event-stream", headers=SSE_HEADERS)
    usage = await unless_disconnected(raw, _run(state, streams, choices))
    return JSONResponse(_full_response(state, choices, usage, model, response_id))


async def _run(state: ServerState, streams: list, choices: list[ChatChoice]) -> dict:
    usage = Usage()
    async for index, output in fan_in(await first_outputs(streams)):
        usage.add(output)
        choices[index].update(output)
    return usage.finish(choices, state.args.enable_cache_report)


class Usage:
    """Token counts over the choices of one request."""

    def __init__(self) -> None:
        self.prompt_tokens = 0
        self.cached_tokens = 0

    def add(self, output: Any) -> None:
        self.prompt_tokens = max(self.prompt_tokens, output.prompt_tokens)
        self.cached_tokens = max(self.cached_tokens, output.cached_tokens)

    def finish(self, choices: list[ChatChoice], cache_report: bool) -> dict:
        completion = sum(c.completion_tokens for c in choices)
        usage = {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": self.prompt_tokens + completion,
            "reasoning_tokens": sum(c.reasoning_tokens for c in choices),
        }
        if cache_report:
            usage["prompt_tokens_details"] = {"cached_tokens": self.cached_tokens}
        return usage


def _full_response(state: ServerState, choices: list, usage: dict, model: str, rid: str) -> dict:
    out = []
    for index, choice in enumerate(choices):
        message = collect(choice.events)
        body: dict[str, Any] = {"role": "assistant", "content": message.content}
        body["reasoning_content"] = message.reasoning
        if message.tool_calls:
            body["tool_calls"] = [
                {"id": c.id, "type": "function", "index": i,
                 "function": {"name": c.name, "arguments": c.arguments}}
                for i, c in enumerate(message.tool_calls)
            ]  # fmt: skip
        out.append({
            "index": index, "message": body, "finish_reason": choice.finish_reason,
            "matched_stop": choice.matched, "logprobs": chat_logprobs(state, choice.logprobs),
        })  # fmt: skip
    return {
        "id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
        "choices": out, "usage": usage,
    }  # fmt: skip


def chat_logprobs(state: ServerState, logprobs: list) -> dict | None:
    if not logprobs:
        return None
    token = state.tokenizer_manager.decode_token

    def entry(token_id: int, logprob: float) -> dict:
        text = token(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    content = [
        entry(lp.token_id, lp.logprob) | {"top_logprobs": [entry(t, p) for t, p in lp.top]}
        for lp in logprobs
    ]
    return {"content": content}


async def _stream(
    state: ServerState, req: ChatCompletionRequest, primed: list, choices: list[ChatChoice],
    model: str, rid: str,
) -> AsyncIterator[str]:  # fmt: skip
    created = int(time.time())

    def chunk(index: int, delta: dict, finish: str | None = None, usage: dict | None = None,
              **extra: Any) -> str:  # fmt: skip
        choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}
        body = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                "choices": [choice | extra]}  # fmt: skip
        if usage is not None:
            body["usage"] = usage
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

    usage = Usage()
    held = ["" for _ in choices]  # reasoning held back when stream_reasoning is false
    try:
        for index in range(len(choices)):
            yield chunk(index, {"role": "assistant", "content": ""})
        async for index, output in fan_in(primed):
            usage.add(output)
            choice = choices[index]
            logprobs = chat_logprobs(state, output.logprobs or [])
            options = req.stream_options
            continuous = options is not None and options.continuous_usage_stats
            for delta in _deltas(choice.update(output)):
                if not req.stream_reasoning and "reasoning_content" in delta:
                    held[index] += delta["reasoning_content"]
                    continue
                if held[index]:
                    yield chunk(index, {"reasoning_content": held[index]})
                    held[index] = ""
                running = usage.finish(choices, False) if continuous else None
                yield chunk(index, delta, usage=running, logprobs=logprobs)
                logprobs = None
            if output.finished:
                if held[index]:
                    yield chunk(index, {"reasoning_content": held[index]})
                yield chunk(index, {}, choice.finish_reason, matched_stop=choice.matched)
        options = req.stream_options
        if options is not None and options.include_usage:
            body = {"id": rid, "object": "chat.completion.chunk", "created": created,
                    "model": model, "choices": [],
                    "usage": usage.finish(choices, state.args.enable_cache_report)}  # fmt: skip
            yield f"data: {json.dumps(body)}\n\n"
    except APIError as e:
        yield f"data: {json.dumps(e.openai_body())}\n\n"
    yield "data: [DONE]\n\n"


def _deltas(events: list[Event]) -> list[dict]:
    deltas = []
    for event in events:
        if isinstance(event, Reasoning):
            deltas.append({"reasoning_content": event.text})
        elif isinstance(event, Content):
            deltas.append({"content": event.text})
        elif isinstance(event, ToolCallStart):
            call = {"index": event.index, "id": event.id, "type": "function",
                    "function": {"name": event.name, "arguments": ""}}  # fmt: skip
            deltas.append({"tool_calls": [call]})
        elif isinstance(event, ToolCallArgs):
            call = {"index": event.index, "function": {"arguments": event.fragment}}
            deltas.append({"tool_calls": [call]})
    return deltas
