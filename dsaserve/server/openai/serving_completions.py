"""`/v1/completions` (raw prompts, no template, no parsers) and SGLang's native `/generate`."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from dsaserve.disaggregation.request_fields import attach_bootstrap
from dsaserve.server.generation import fan_in, first_outputs, unless_disconnected
from dsaserve.server.openai.protocol import CompletionRequest, GenerateRequestIn
from dsaserve.server.openai.serving_chat import SSE_HEADERS
from dsaserve.server.state import ServerState
from dsaserve.web.errors import APIError, bad_request


def _prompts(state: ServerState, prompt: Any) -> list[list[int]]:
    """Token ids of each prompt (run in a worker thread: tokenizing releases the GIL)."""
    tm = state.tokenizer_manager
    if isinstance(prompt, str):
        return [tm.encode(prompt)]
    if prompt and all(isinstance(p, int) for p in prompt):
        return [list(prompt)]
    if not prompt:
        raise bad_request("prompt must not be empty", "prompt")
    tm.check_sequences(len(prompt), "prompt")  # before tokenizing them all
    return [tm.encode(p) if isinstance(p, str) else list(p) for p in prompt]


def _prepare_completions(state: ServerState, req: CompletionRequest) -> tuple[list, list, str]:
    tm = state.tokenizer_manager
    base = req.rid or uuid.uuid4().hex
    prompts = _prompts(state, req.prompt)
    tm.check_sequences(len(prompts) * req.n, "n" if len(prompts) == 1 else "prompt")
    requests, prompt_ids = [], []
    fields = req.model_dump()
    fields.update(tm.structured.native_fields(fields))  # in this worker thread: it may compile
    for p, ids in enumerate(prompts):
        param = "prompt" if len(prompts) == 1 else f"prompt[{p}]"
        if not ids:
            raise bad_request("prompt must not be empty", param)
        room = tm.fit_max_tokens(len(ids), req.max_tokens, "max_tokens", param)
        sampling = tm.sampling(fields, room)
        for r in tm.make_requests(ids, sampling, f"{base}-{p}"):
            requests.append(r)
            prompt_ids.append(ids)
    return requests, prompt_ids, base


async def completions(state: ServerState, req: CompletionRequest, raw: Request) -> Any:
    if req.suffix:
        raise bad_request("suffix is not supported", "suffix")
    tm = state.tokenizer_manager
    requests, prompt_ids, base = await asyncio.to_thread(_prepare_completions, state, req)
    model = req.model or tm.model_name
    attach_bootstrap(state.args, req, requests)
    streams = await state.engine.submit(requests)
    if req.stream:
        primed = await unless_disconnected(raw, first_outputs(streams))
        body = _stream_completions(state, req, primed, prompt_ids, model, f"cmpl-{base}")
        return StreamingResponse(body, media_type="text/event-stream", headers=SSE_HEADERS)
    outputs = await unless_disconnected(raw, _collect(streams))
    choices = []
    for index, parts in enumerate(outputs):
        text = "".join(o.text for o in parts)
        if req.echo:
            text = tm.tokenizer.decode(prompt_ids[index]) + text
        last = parts[-1]
        choices.append({
            "index": index, "text": text, "logprobs": _logprobs(state, parts, req.logprobs),
            "finish_reason": (last.finish_reason or {}).get("type"),
            "matched_stop": (last.finish_reason or {}).get("matched"),
        })  # fmt: skip
    return JSONResponse({
        "id": f"cmpl-{base}", "object": "text_completion", "created": int(time.time()),
        "model": model, "choices": choices, "usage": _usage(state, outputs),
    })  # fmt: skip


async def _collect(streams: list) -> list[list[Any]]:
    primed = await first_outputs(streams)
    outputs: list[list[Any]] = [[] for _ in primed]
    async for index, output in fan_in(primed):
        outputs[index].append(output)
    return outputs


def _usage(state: ServerState, outputs: list[list[Any]]) -> dict:
    prompt = sum(parts[-1].prompt_tokens for parts in outputs)
    completion = sum(parts[-1].completion_tokens for parts in outputs)
    usage = {"prompt_tokens": prompt, "completion_tokens": completion,
             "total_tokens": prompt + completion}  # fmt: skip
    if state.args.enable_cache_report:
        cached = sum(parts[-1].cached_tokens for parts in outputs)
        usage["prompt_tokens_details"] = {"cached_tokens": cached}
    return usage


def _logprobs(state: ServerState, parts: list, top: int | None) -> dict | None:
    if top is None:
        return None
    decode = state.tokenizer_manager.decode_token
    entries = [lp for o in parts for lp in (o.logprobs or [])]
    return {
        "tokens": [decode(lp.token_id) for lp in entries],
        "token_logprobs": [lp.logprob for lp in entries],
        "top_logprobs": [{decode(t): p for t, p in lp.top} for lp in entries],
    }


async def _stream_completions(
    state: ServerState, req: CompletionRequest, primed: list, prompt_ids: list, model: str,
    rid: str,
) -> AsyncIterator[str]:  # fmt: skip
    created = int(time.time())
    last: dict[int, Any] = {}
    try:
        async for index, output in fan_in(primed):
            last[index] = output
            finish = (output.finish_reason or {}).get("type") if output.finished else None
            choice = {"index": index, "text": output.text, "finish_reason": finish,
                      "logprobs": _logprobs(state, [output], req.logprobs)}  # fmt: skip
            body = {"id": rid, "object": "text_completion", "created": created, "model": model,
                    "choices": [choice]}  # fmt: skip
            yield f"data: {json.dumps(body, ensure_ascii=False)}\n\n"
        if req.stream_options is not None and req.stream_options.include_usage:
            usage = _usage(state, [[o] for o in last.values()])
            body = {"id": rid, "object": "text_completion", "created": created, "model": model,
                    "choices": [], "usage": usage}  # fmt: skip
            yield f"data: {json.dumps(body)}\n\n"
    except APIError as e:
        yield f"data: {json.dumps(e.openai_body())}\n\n"
    yield "data: [DONE]\n\n"


def _prepare_generate(state: ServerState, req: GenerateRequestIn) -> list:
    tm = state.tokenizer_manager
    if (req.text is None) == (req.input_ids is None):
        raise bad_request("give exactly one of text or input_ids", "text")
    param = "text" if req.text is not None else "input_ids"
    ids = tm.encode(req.text) if req.text is not None else list(req.input_ids or [])
    if not ids:
        raise bad_request("the prompt must not be empty", param)
    fields = req.sampling_params.engine_fields()
    fields.update(tm.structured.native_fields(fields, "sampling_params."))
    if req.return_logprob:
        fields["logprobs"] = req.top_logprobs_num
    max_tokens = fields.pop("max_tokens")
    room = tm.fit_max_tokens(len(ids), max_tokens, "sampling_params.max_new_tokens", param)
    requests = tm.make_requests(ids, tm.sampling(fields, room), req.rid)
    attach_bootstrap(state.args, req, requests)
    return requests


async def generate(state: ServerState, req: GenerateRequestIn, raw: Request) -> Any:
    """SGLang's `/generate`: text or input_ids; answers `text`, `output_ids` and `meta_info`."""
    requests = await asyncio.to_thread(_prepare_generate, state, req)
    streams = await state.engine.submit(requests)
    if req.stream:
        primed = await unless_disconnected(raw, first_outputs(streams))
        body = _stream_native(primed)
        return StreamingResponse(body, media_type="text/event-stream", headers=SSE_HEADERS)
    outputs = await unless_disconnected(raw, _collect(streams))
    answers = [_native(parts) for parts in outputs]
    return JSONResponse(answers[0] if len(answers) == 1 else answers)


def _native(parts: list[Any]) -> dict:
    last = parts[-1]
    meta = {
        "id": last.rid, "prompt_tokens": last.prompt_tokens,
        "completion_tokens": last.completion_tokens, "cached_tokens": last.cached_tokens,
        "finish_reason": last.finish_reason, "spec_verify_ct": last.spec_verify_ct,
    }  # fmt: skip
    if last.spec_accept_length is not None:
        meta["spec_accept_length"] = last.spec_accept_length
        meta["spec_accept_rate"] = last.spec_accept_rate
        meta["spec_num_correct_drafts"] = last.spec_num_correct_drafts
        meta["spec_num_proposed_drafts"] = last.spec_num_proposed_drafts
    return {
        "text": "".join(p.text for p in parts),
        "output_ids": [t for p in parts for t in p.token_ids],
        "meta_info": meta,
    }


async def _stream_native(primed: list) -> AsyncIterator[str]:
    seen: dict[int, list] = {}
    try:
        async for index, output in fan_in(primed):
            seen.setdefault(index, []).append(output)
            answer = _native(seen[index]) | {"index": index}
            yield f"data: {json.dumps(answer, ensure_ascii=False)}\n\n"
    except APIError as e:
        yield f"data: {json.dumps(e.openai_body())}\n\n"
    yield "data: [DONE]\n\n"
