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
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel
from starlette.exceptions import HTTPException

from dsaserve import __version__
from dsaserve.server.anthropic import serving as anthropic
from dsaserve.server.anthropic.protocol import CountTokensRequest, MessagesRequest
from dsaserve.server.body_decoder import BodyDecoder
from dsaserve.server.console import add_console_routes
from dsaserve.server.dp_controller import dp_metrics_text, load_report
from dsaserve.server.openai import serving_chat, serving_completions, serving_responses
from dsaserve.server.openai.protocol import (
    AbortIn,
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequestIn,
)
from dsaserve.server.openai.responses_protocol import ResponsesRequest
from dsaserve.server.openai.responses_store import ResponseStore
from dsaserve.server.openapi import build_openapi, operation_extra
from dsaserve.server.state import ServerState
from dsaserve.server.validation import check_content_type
from dsaserve.web.errors import APIError

logger = logging.getLogger("dsaserve.server")
HEALTH_GENERATE_TIMEOUT_S = 20.0
OPEN_PATHS = ("/health", "/health_generate", "/metrics")
ERROR_APIS = (("/v1/messages", "anthropic"), ("/v1/responses", "responses"))
# a route's gate: SERVING answers 503 while starting, draining or after the engine died; STARTED
# only while starting (what the model card, the flags and the stats need); OPEN never
SERVING, STARTED, OPEN = "serving", "started", "open"

Handler = Callable[..., Awaitable[Any]]


def build_app(state: ServerState) -> FastAPI:
    """All routes over one shared `ServerState`. A route with a `body` model gets the body
    decoded and validated (off the loop when large) and passed as `body`; the same models
    describe the bodies in `/openapi.json`, which is served behind the API key."""
    app = FastAPI(title="dsaserve", version=__version__, docs_url=None, redoc_url=None,
                  openapi_url=None)  # fmt: skip
    app.state.server = state
    app.add_middleware(InFlight, state=state)
    app.add_exception_handler(HTTPException, _http_error)
    if state.body_decoder is None:
        state.body_decoder = BodyDecoder(use_processes=False)
    if state.response_store is None:
        state.response_store = ResponseStore(state.args.responses_store_size)
    bodies: list[type[BaseModel]] = []

    def route(path: str, methods: list[str], errors: str = "openai", gate: str = SERVING,
              body: type[BaseModel] | None = None,
              response_class: type = JSONResponse):  # fmt: skip
        def register(handler: Handler) -> Handler:
            async def endpoint(request: Request) -> Any:
                return await _guarded(state, request, handler, errors, gate, body)

            if body is not None and body not in bodies:
                bodies.append(body)
            app.add_api_route(path, endpoint, methods=methods, name=handler.__name__,
                              response_class=response_class,
                              openapi_extra=operation_extra(body, path))  # fmt: skip
            return handler

        return register

    _add_generation_routes(route)
    _add_admin_routes(route, state)
    add_console_routes(app, state.args.api_key, chat=True)  # no engine, no key, no gate

    @route("/openapi.json", ["GET"], gate=OPEN)
    async def openapi(state: ServerState, request: Request) -> Any:
        return build_openapi(app, bodies)

    return app


def _add_generation_routes(route: Callable) -> None:
    """The inference routes: OpenAI (chat, completions, responses), native and Anthropic."""

    @route("/v1/chat/completions", ["POST"], body=ChatCompletionRequest)
    async def chat(state: ServerState, request: Request, body: ChatCompletionRequest) -> Any:
        return await serving_chat.chat_completions(state, body, request)

    @route("/v1/completions", ["POST"], body=CompletionRequest)
    async def completions(state: ServerState, request: Request, body: CompletionRequest) -> Any:
        return await serving_completions.completions(state, body, request)

    @route("/generate", ["POST", "PUT"], body=GenerateRequestIn)
    async def generate(state: ServerState, request: Request, body: GenerateRequestIn) -> Any:
        return await serving_completions.generate(state, body, request)

    @route("/v1/responses", ["POST"], errors="responses", body=ResponsesRequest)
    async def responses(state: ServerState, request: Request, body: ResponsesRequest) -> Any:
        return await serving_responses.create(state, body, request)

    @route("/v1/responses/{response_id}", ["GET"], errors="responses")
    async def get_response(state: ServerState, request: Request) -> Any:
        return serving_responses.retrieve(state, request.path_params["response_id"])

    @route("/v1/responses/{response_id}", ["DELETE"], errors="responses")
    async def delete_response(state: ServerState, request: Request) -> Any:
        return serving_responses.delete(state, request.path_params["response_id"])

    @route("/v1/messages", ["POST"], errors="anthropic", body=MessagesRequest)
    async def messages(state: ServerState, request: Request, body: MessagesRequest) -> Any:
        return await anthropic.messages(state, body, request)

    @route("/v1/messages/count_tokens", ["POST"], errors="anthropic", body=CountTokensRequest)
    async def count_tokens(state: ServerState, request: Request, body: CountTokensRequest) -> Any:
        return await anthropic.count_tokens(state, body)


def _add_admin_routes(route: Callable, state: ServerState) -> None:
    """Models, health, info, load, cache, abort and metrics."""
    app_route_alias = lambda path, handler: route(path, ["GET"], gate=STARTED)(handler)  # noqa: E731

    @route("/v1/models", ["GET"], gate=STARTED)
    async def models(state: ServerState, request: Request) -> Any:
        return {"object": "list", "data": [_model_card(state)]}

    @route("/v1/models/{model_id:path}", ["GET"], gate=STARTED)
    async def model(state: ServerState, request: Request) -> Any:
        return _model_card(state)

    @route("/health", ["GET"], gate=OPEN, response_class=Response)
    async def health(state: ServerState, request: Request) -> Any:
        _check_serving(state)
        _check_heartbeats(state)
        return Response(status_code=200)

    @route("/health_generate", ["GET"], gate=OPEN, response_class=Response)
    async def health_generate(state: ServerState, request: Request) -> Any:
        return await _health_generate(state)

    @route("/get_server_info", ["GET"], gate=STARTED)
    async def server_info(state: ServerState, request: Request) -> Any:
        return await _server_info(state)

    @route("/get_model_info", ["GET"], gate=STARTED)
    async def model_info(state: ServerState, request: Request) -> Any:
        tm = state.tokenizer_manager
        return {"model_path": state.args.model_id or state.args.model_path,
                "tokenizer_path": state.args.tokenizer_path,
                "served_model_name": tm.model_name if tm else None,
                "is_generation": True, "context_length": tm.context_length if tm else None,
                "model_type": "glm_moe_dsa"}  # fmt: skip

    # the names sglang-router asks for first (it falls back to the get_ ones)
    app_route_alias("/server_info", server_info)
    app_route_alias("/model_info", model_info)

    @route("/get_load", ["GET"], gate=STARTED)
    async def get_load(state: ServerState, request: Request) -> Any:
        """SGLang's load report, one entry per attention group (sglang-router's power_of_two
        reads num_tokens), from the stats the engine last published."""
        stats = {}
        if state.engine is not None and state.engine.dead is None and state.ready:
            stats = state.engine.stats
        return load_report(stats)

    @route("/flush_cache", ["GET", "POST"])
    async def flush_cache(state: ServerState, request: Request) -> Any:
        if not await state.engine.control("flush_cache"):
            raise APIError(400, "cache not flushed: requests are running or waiting")
        if state.args.enable_hierarchical_cache:
            kept = " (the storage tier is kept)" if state.args.hicache_storage_backend else ""
            return {"success": True, "message": f"flushed the device and host KV tiers{kept}"}
        return {"success": True}

    @route("/abort_request", ["POST"], body=AbortIn)
    async def abort_request(state: ServerState, request: Request, body: AbortIn) -> Any:
        if not body.rid and not body.abort_all:
            raise APIError(400, "give rid, or abort_all: true", param="rid")
        rids = [r for r in state.engine.in_flight_rids() if body.abort_all or _owns(body.rid, r)]
        state.engine.abort(rids, by_client=not body.abort_all)  # a rid: its client's cancel
        return {"aborted": rids}

    if state.args.enable_metrics:

        @route("/metrics", ["GET"], gate=STARTED, response_class=PlainTextResponse)
        async def metrics(state: ServerState, request: Request) -> Any:
            stats = state.engine.stats if state.engine.dead is None else {}
            text = state.metrics.render(stats) + dp_metrics_text(state.metrics.model, stats)
            return Response(text, media_type="text/plain; version=0.0.4")


async def _guarded(
    state: ServerState, request: Request, handler: Handler, errors: str, gate: str,
    body: type[BaseModel] | None,
) -> Any:  # fmt: skip
    try:
        _authenticate(state, request)
        check_content_type(request)
        if gate == SERVING:
            _check_serving(state)
        elif gate == STARTED:
            _check_started(state)
        if body is None:
            return await handler(state, request)
        return await handler(state, request, body=await _parse(state, request, body))
    except APIError as e:
        return e.response_in(errors)
    except Exception:
        logger.exception("internal error on %s", request.url.path)
        return APIError(500, "internal server error").response_in(errors)


async def _parse(state: ServerState, request: Request, model: type[BaseModel]) -> Any:
    tm = state.tokenizer_manager
    context = tm.validation_context() if tm is not None else {"max_n": state.args.max_n}
    limit = state.args.max_request_bytes
    return await state.body_decoder.read_and_decode(request, limit, model, context)


async def _http_error(request: Request, error: Exception) -> Response:
    """404, 405 and other routing errors in the API's own error shape."""
    status = error.status_code if isinstance(error, HTTPException) else 500
    detail = error.detail if isinstance(error, HTTPException) else "internal server error"
    answer = APIError(status, f"{request.method} {request.url.path[:100]}: {detail}")
    path = request.url.path
    api = next((api for prefix, api in ERROR_APIS if path.startswith(prefix)), "openai")
    response = answer.response_in(api)
    response.headers.update(getattr(error, "headers", None) or {})  # 405: Allow
    return response


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


def _check_started(state: ServerState) -> None:
    """503 until the engine is loaded (or after it died before that)."""
    if state.engine is not None and state.engine.dead is not None and not state.ready:
        raise APIError(503, f"engine unavailable: {state.engine.dead}", code="engine_dead")
    if not state.ready:
        raise APIError(503, "server is starting", retry_after=5)


def _check_heartbeats(state: ServerState) -> None:
    """503 while a rank (of any node) misses its heartbeat (a stopped or wedged process; the
    watchdog ends it later): runtime/heartbeat.py."""
    late = state.heartbeats.late() if state.heartbeats is not None else None
    if late:
        raise APIError(503, f"engine unavailable: {late}", code="rank_unresponsive",
                       retry_after=5)  # fmt: skip


def _check_serving(state: ServerState) -> None:
    if state.engine is not None and state.engine.dead is not None:
        raise APIError(503, f"engine unavailable: {state.engine.dead}", code="engine_dead")
    _check_started(state)
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
            "owned_by": "dsaserve", "root": state.args.model_id or state.args.model_path,
            "max_model_len": tm.context_length}  # fmt: skip


async def _health_generate(state: ServerState) -> Response:
    _check_serving(state)
    _check_heartbeats(state)
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
    """The flags and the engine stats last published (never waits for a step)."""
    stats = {}
    if state.engine is not None and state.engine.dead is None and state.ready:
        stats = dict(state.engine.stats)
    tm = state.tokenizer_manager
    return {
        **dataclasses.asdict(state.args), "api_key": "***" if state.args.api_key else None,
        "cluster_secret": "***" if state.args.cluster_secret else None,
        "served_model_name": tm.model_name if tm else state.args.served_model_name,
        "version": __version__,
        "engine_pid": state.engine_info.get("pid"),
        "dp_group_pids": state.engine_info.get("group_pids"),
        "context_length": tm.context_length if tm else None,
        "resolved_reasoning_parser": tm.reasoning_parser if tm else None,
        "resolved_tool_call_parser": tm.tool_parser if tm else None,
        "internal_states": [stats], "draining": state.draining,
    }  # fmt: skip
