"""The FastAPI application: routes, authentication, readiness/draining gates, error envelopes."""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response

from dsaserve import __version__
from dsaserve.distributed.controller import dp_metrics_text, load_report
from dsaserve.server.anthropic import serving as anthropic
from dsaserve.server.anthropic.protocol import CountTokensRequest, MessagesRequest
from dsaserve.server.console import add_console_routes
from dsaserve.server.errors import APIError
from dsaserve.server.openai import serving_chat, serving_completions
from dsaserve.server.openai.protocol import (
    AbortIn,
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequestIn,
)
from dsaserve.server.state import ServerState
from dsaserve.server.validation import parse

logger = logging.getLogger("dsaserve.server")
HEALTH_GENERATE_TIMEOUT_S = 20.0
OPEN_PATHS = ("/health", "/health_generate", "/metrics")

Handler = Callable[[ServerState, Request], Awaitable[Any]]


def build_app(state: ServerState) -> FastAPI:
    """All routes over one shared `ServerState`."""
    app = FastAPI(title="dsaserve", version=__version__, docs_url=None, redoc_url=None)
    app.state.server = state
    app.add_middleware(InFlight, state=state)

    def route(path: str, methods: list[str], anthropic_errors: bool = False, gate: bool = True):
        def register(handler: Handler) -> Handler:
            async def endpoint(request: Request) -> Any:
                return await _guarded(state, request, handler, anthropic_errors, gate)

            app.add_api_route(path, endpoint, methods=methods, name=handler.__name__)
            return handler

        return register

    _add_generation_routes(route, state.args.max_request_bytes)
    _add_admin_routes(route, state)
    add_console_routes(app, state.args.api_key, chat=True)  # no engine, no key, no gate
    return app


def _add_generation_routes(route: Callable, limit: int) -> None:
    """The inference routes: OpenAI, native and Anthropic."""

    @route("/v1/chat/completions", ["POST"])
    async def chat(state: ServerState, request: Request) -> Any:
        body = await parse(request, ChatCompletionRequest, limit)
        return await serving_chat.chat_completions(state, body, request)

    @route("/v1/completions", ["POST"])
    async def completions(state: ServerState, request: Request) -> Any:
        body = await parse(request, CompletionRequest, limit)
        return await serving_completions.completions(state, body, request)

    @route("/generate", ["POST", "PUT"])
    async def generate(state: ServerState, request: Request) -> Any:
        body = await parse(request, GenerateRequestIn, limit)
        return await serving_completions.generate(state, body, request)

    @route("/v1/messages", ["POST"], anthropic_errors=True)
    async def messages(state: ServerState, request: Request) -> Any:
        body = await parse(request, MessagesRequest, limit)
        return await anthropic.messages(state, body, request)

    @route("/v1/messages/count_tokens", ["POST"], anthropic_errors=True)
    async def count_tokens(state: ServerState, request: Request) -> Any:
        body = await parse(request, CountTokensRequest, limit)
        return await anthropic.count_tokens(state, body)


def _add_admin_routes(route: Callable, state: ServerState) -> None:
    """Models, health, info, cache, abort and metrics."""
    limit = state.args.max_request_bytes

    @route("/v1/models", ["GET"], gate=False)
    async def models(state: ServerState, request: Request) -> Any:
        return {"object": "list", "data": [_model_card(state)]}

    @route("/v1/models/{model_id:path}", ["GET"], gate=False)
    async def model(state: ServerState, request: Request) -> Any:
        return _model_card(state)

    @route("/health", ["GET"], gate=False)
    async def health(state: ServerState, request: Request) -> Any:
        _check_serving(state)
        return Response(status_code=200)

    @route("/health_generate", ["GET"], gate=False)
    async def health_generate(state: ServerState, request: Request) -> Any:
        return await _health_generate(state)

    @route("/get_server_info", ["GET"], gate=False)
    async def server_info(state: ServerState, request: Request) -> Any:
        return await _server_info(state)

    @route("/get_load", ["GET"], gate=False)
    async def get_load(state: ServerState, request: Request) -> Any:
        return load_report(await state.engine.control("stats"))

    @route("/get_model_info", ["GET"], gate=False)
    async def model_info(state: ServerState, request: Request) -> Any:
        tm = state.tokenizer_manager
        return {"model_path": state.args.model_path, "tokenizer_path": state.args.tokenizer_path,
                "is_generation": True, "context_length": tm.context_length}  # fmt: skip

    @route("/flush_cache", ["GET", "POST"])
    async def flush_cache(state: ServerState, request: Request) -> Any:
        if not await state.engine.control("flush_cache"):
            raise APIError(400, "cache not flushed: requests are running or waiting")
        return {"success": True}

    @route("/abort_request", ["POST"])
    async def abort_request(state: ServerState, request: Request) -> Any:
        body = await parse(request, AbortIn, limit)
        if not body.rid and not body.abort_all:
            raise APIError(400, "give rid, or abort_all: true", param="rid")
        rids = [r for r in state.engine.in_flight_rids() if body.abort_all or _owns(body.rid, r)]
        state.engine.abort(rids)
        return {"aborted": rids}

    if state.args.enable_metrics:

        @route("/metrics", ["GET"], gate=False)
        async def metrics(state: ServerState, request: Request) -> Any:
            stats = await state.engine.control("stats") if state.engine.dead is None else {}
            text = state.metrics.render(stats) + dp_metrics_text(state.metrics.model, stats)
            return Response(text, media_type="text/plain; version=0.0.4")


async def _guarded(
    state: ServerState, request: Request, handler: Handler, anthropic_errors: bool, gate: bool
) -> Any:
    try:
        _authenticate(state, request)
        if gate:
            _check_serving(state)
        return await handler(state, request)
    except APIError as e:
        return e.anthropic_response() if anthropic_errors else e.openai_response()
    except Exception:
        logger.exception("internal error on %s", request.url.path)
        error = APIError(500, "internal server error")
        return error.anthropic_response() if anthropic_errors else error.openai_response()


def _authenticate(state: ServerState, request: Request) -> None:
    key = state.args.api_key
    if not key or request.url.path in OPEN_PATHS:
        return
    given = request.headers.get("authorization", "")
    given = given[7:] if given.lower().startswith("bearer ") else ""
    if request.url.path.startswith("/v1/messages") and not given:
        given = request.headers.get("x-api-key", "")
    if not hmac.compare_digest(given.encode(), key.encode()):
        raise APIError(401, "invalid or missing API key", code="invalid_api_key")


def _check_serving(state: ServerState) -> None:
    if state.engine is not None and state.engine.dead is not None:
        raise APIError(503, f"engine unavailable: {state.engine.dead}", code="engine_dead")
    if not state.ready:
        raise APIError(503, "server is starting", retry_after=5)
    if state.draining:
        raise APIError(503, "server is shutting down", retry_after=5)


class InFlight:
    """ASGI middleware counting open HTTP requests (a stream counts until its body is sent)."""

    def __init__(self, app: Any, state: ServerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http" or scope.get("path") in OPEN_PATHS:
            return await self.app(scope, receive, send)
        self.state.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.state.in_flight -= 1


def _owns(rid: str, engine_rid: str) -> bool:
    """Whether an engine rid belongs to request `rid` (`rid`, or `rid-<i>[-<j>]` for choices)."""
    suffix = engine_rid[len(rid) :] if engine_rid.startswith(rid) else None
    return (
        suffix is not None
        and (suffix == "" or suffix.replace("-", "").isdigit())
        and (suffix == "" or suffix.startswith("-"))
    )


def _model_card(state: ServerState) -> dict:
    tm = state.tokenizer_manager
    return {"id": tm.model_name, "object": "model", "created": int(time.time()),
            "owned_by": "dsaserve", "root": state.args.model_path,
            "max_model_len": tm.context_length}  # fmt: skip


async def _health_generate(state: ServerState) -> Response:
    _check_serving(state)
    tm = state.tokenizer_manager
    sampling = tm.sampling({"temperature": 0.0}, 1)
    requests = tm.make_requests(tm.encode("hi") or [0], sampling, f"health-{time.time_ns()}")
    streams = await state.engine.submit(requests)

    async def run() -> None:
        async for output in streams[0]:
            if output.finished:
                return

    try:
        await asyncio.wait_for(run(), HEALTH_GENERATE_TIMEOUT_S)
    except TimeoutError as e:
        raise APIError(503, "health generation timed out") from e
    return Response(status_code=200)


async def _server_info(state: ServerState) -> dict:
    stats = {}
    if state.engine is not None and state.engine.dead is None and state.ready:
        stats = await state.engine.control("stats")
    tm = state.tokenizer_manager
    return {
        **dataclasses.asdict(state.args), "api_key": "***" if state.args.api_key else None,
        "version": __version__,
        "engine_pid": state.engine_info.get("pid"),
        "context_length": tm.context_length if tm else None,
        "resolved_reasoning_parser": tm.reasoning_parser if tm else None,
        "resolved_tool_call_parser": tm.tool_parser if tm else None,
        "internal_states": [stats], "draining": state.draining,
    }  # fmt: skip
