"""The web console: its static page at `/console` and the planner's JSON routes.

`GET /api/plan/options`, `POST /api/plan` and `GET /api/plan/matrix` wrap `dsaserve.deploy.api`
(the function behind `dsaserve plan --json`). None of these routes touch the engine, so they
answer while it loads, drains or is dead, and they need no API key: the page itself holds the key
field, and the planner only computes. The chat half of the page calls the server's own API.

The bodies are bounded like the API's (64 KiB, JSON nested at most 64 deep: a 4xx in the planner's
error shape). A matrix is a pure function of the planner's tables and its query, so each query's
is computed once (one at a time, off the loop) and kept (the last `MATRIX_CACHE` queries).
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, RedirectResponse, Response

from dsaserve import __version__
from dsaserve.deploy.api import coerce_query, invalid_body, plan_answer, plan_matrix, plan_options
from dsaserve.deploy.hardware import PlanError
from dsaserve.web.errors import APIError
from dsaserve.web.json_limits import decode_json

ASSETS = Path(__file__).resolve().parent.parent / "assets" / "console"
MEDIA_TYPES = {
    "index.html": "text/html; charset=utf-8",
    "console.js": "text/javascript; charset=utf-8",
    "console.css": "text/css; charset=utf-8",
}
MAX_PLAN_BODY = 64 * 1024
MATRIX_CACHE = 64
# the page loads nothing from elsewhere, and says so to the browser
PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; object-src 'none'; "
    "base-uri 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-cache",
}


def add_console_routes(app: FastAPI, api_key: str | None, chat: bool) -> None:
    """Register the page and the planner routes on `app`; `chat` says a model is served."""
    config = {"chat": chat, "api_key_required": bool(api_key), "version": __version__}

    async def console_root(request: Request) -> Response:
        return RedirectResponse("/console/", status_code=307)

    async def console_index() -> Response:
        return await console_file("index.html")

    async def console_file(name: str) -> Response:
        if name not in MEDIA_TYPES:
            return JSONResponse(invalid_body(f"no console file {name!r}"), 404)
        return FileResponse(ASSETS / name, media_type=MEDIA_TYPES[name], headers=PAGE_HEADERS)

    async def console_config() -> dict[str, Any]:
        return config

    app.add_api_route("/console", console_root, methods=["GET"], include_in_schema=False)
    app.add_api_route("/console/", console_index, methods=["GET"], include_in_schema=False)
    app.add_api_route("/console/config.json", console_config, methods=["GET"])
    app.add_api_route("/console/{name}", console_file, methods=["GET"], include_in_schema=False)
    app.add_api_route("/api/plan/options", _options, methods=["GET"])
    app.add_api_route("/api/plan", _plan, methods=["POST"])
    app.add_api_route("/api/plan/matrix", _matrix, methods=["GET"])


async def _options() -> dict[str, Any]:
    return plan_options()


async def _plan(request: Request) -> JSONResponse:
    body = await request.body()
    if len(body) > MAX_PLAN_BODY:
        return JSONResponse(invalid_body(f"request body over {MAX_PLAN_BODY} bytes"), 413)
    try:
        fields = decode_json(body or b"{}")
    except APIError as e:
        return JSONResponse(invalid_body(e.message, e.param), e.status)
    answer = await asyncio.to_thread(plan_answer, fields)  # keep the HTTP loop free
    return JSONResponse(answer.body, answer.http_status)


async def _matrix(request: Request) -> JSONResponse:
    try:
        matrix = await _cached_matrix(coerce_query(dict(request.query_params)))
    except PlanError as e:
        return JSONResponse(invalid_body(str(e), getattr(e, "param", None)), 400)
    return Response(matrix, media_type="application/json")


class _Matrices:
    """The matrix of each recent query, as its JSON bytes; computed once, one at a time, off the
    event loop."""

    def __init__(self) -> None:
        self.done: OrderedDict[tuple, bytes] = OrderedDict()
        self.lock = threading.Lock()

    async def get(self, fixed: dict[str, Any]) -> bytes:
        key = tuple(sorted(fixed.items()))
        found = self.done.get(key)
        return found if found is not None else await asyncio.to_thread(self._compute, key, fixed)

    def _compute(self, key: tuple, fixed: dict[str, Any]) -> bytes:
        with self.lock:  # a burst of one query computes it once; the others find it done
            if key not in self.done:
                self.done[key] = json.dumps(plan_matrix(fixed)).encode()
                while len(self.done) > MATRIX_CACHE:
                    self.done.popitem(last=False)
            return self.done[key]


_cached_matrix = _Matrices().get


def build_console_app() -> FastAPI:
    """The console alone, for `dsaserve plan --web`: the Deploy panel, no model, no chat."""
    app = FastAPI(title="dsaserve console", version=__version__, docs_url=None, redoc_url=None)
    add_console_routes(app, api_key=None, chat=False)
    return app
