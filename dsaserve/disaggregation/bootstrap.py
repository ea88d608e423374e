"""The prefill's bootstrap server (SGLang's `--disaggregation-bootstrap-port`) and its client.

- `PUT /route`: a prefill rank registers `{attn_tp_size, attn_tp_rank, attn_cp_size, ...,
  rank_ip, rank_port, page_size, kv_cache_dtype}`; the answer carries its `registration_id`
  (rank_table.py: a registered rank is never replaced by another process).
- `GET /route?prefill_dp_rank=-1&prefill_cp_rank=-1&target_tp_rank=-1&target_pp_rank=-1`: the
  server's layout (503 until every rank registered); with real ranks: that rank's
  `{rank_ip, rank_port}` (404 when unknown).
- `GET /health`: the decode's heartbeat (open, like the API's).

With a cluster secret both `/route` methods need `Authorization: Bearer <secret>` (401). It runs
uvicorn on a thread of the engine process with the API's limits: `--header-timeout` for headers
and for each piece of a body, a 64 KiB body cap (413), JSON nested at most 64 deep (400), at most
64 open connections (503 beyond), keep-alive 5 s; one event loop, no thread per connection.
"""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.error
import urllib.request
from typing import Any
from urllib.parse import parse_qs

import uvicorn

from dsaserve.cluster.secret import bearer, bearer_ok
from dsaserve.disaggregation.rank_table import RANK_KEYS, RankTable
from dsaserve.web.errors import APIError
from dsaserve.web.http_limits import uvicorn_limits
from dsaserve.web.json_limits import decode_json

MAX_BODY_BYTES = 64 * 1024
MAX_CONNECTIONS = 64
START_TIMEOUT_S = 10.0


class BootstrapServer:
    """The rank table behind a small HTTP server on its own thread."""

    def __init__(self, host: str, port: int, secret: str | None, header_timeout: float) -> None:
        self.table = RankTable()
        self.secret = secret
        self.socket = socket.create_server((host, port), family=_family(host), backlog=128)
        self.port = self.socket.getsockname()[1]
        config = uvicorn.Config(self._app, interface="asgi3", lifespan="off", log_level="error",
                                access_log=False, proxy_headers=False,
                                timeout_keep_alive=5,
                                **uvicorn_limits(header_timeout, MAX_CONNECTIONS))  # fmt: skip
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.socket]},
                                       daemon=True, name="pd-bootstrap")  # fmt: skip
        self.thread.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self.server.started and self.thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(5)
        self.socket.close()

    async def _app(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        status, body = await self._answer(scope, receive)
        data = (json.dumps(body) if isinstance(body, dict) else body).encode()
        kind = b"application/json" if isinstance(body, dict) else b"text/plain"
        headers = [(b"content-type", kind), (b"content-length", str(len(data)).encode())]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": data})

    async def _answer(self, scope: dict, receive: Any) -> tuple[int, dict | str]:
        path, method = scope["path"], scope["method"]
        if path == "/health":
            return (200, "OK") if method == "GET" else (405, "method not allowed")
        if path != "/route":
            return 404, "not found"
        headers = dict(scope["headers"])
        if not bearer_ok(headers.get(b"authorization", b"").decode("latin-1"), self.secret):
            return 401, "invalid or missing cluster secret (Authorization: Bearer ...)"
        if method == "GET":
            return self.table.route(parse_qs(scope["query_string"].decode("latin-1")))
        if method != "PUT":
            return 405, "method not allowed"
        declared = headers.get(b"content-length", b"")
        if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
            return 413, f"registration over {MAX_BODY_BYTES} bytes"
        body = await _read_body(receive)
        if isinstance(body, tuple):
            return body
        try:
            data = decode_json(body)
        except APIError as e:
            return 400, f"bad registration: {e.message}"
        return self.table.register(data)


async def _read_body(receive: Any) -> bytes | tuple[int, str]:
    """The whole body, or the answer refusing it (a client that went away gets none)."""
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return 400, "the client went away mid-body"
        chunks.append(message.get("body", b""))
        size += len(chunks[-1])
        if size > MAX_BODY_BYTES:
            return 413, f"registration over {MAX_BODY_BYTES} bytes"
        if not message.get("more_body"):
            return b"".join(chunks)


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


# ---- the client side (prefill ranks register; decodes look up and send heartbeats) ----------
def _request(method: str, url: str, body: dict | None, timeout: float,
             secret: str | None = None) -> tuple[int, bytes]:  # fmt: skip
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, method=method, headers=bearer(secret))
    request.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read(MAX_BODY_BYTES)
    except urllib.error.HTTPError as e:
        return e.code, e.read(MAX_BODY_BYTES)


def register_rank(address: str, data: dict, secret: str | None, timeout: float = 5.0,
                  wait: float = 0.0) -> str:  # fmt: skip
    """`PUT /route`; the registration_id that lets this process re-register the rank. `wait`:
    seconds to keep trying while nothing listens at `address` yet."""
    deadline = time.monotonic() + wait
    while True:
        try:
            status, body = _request("PUT", f"http://{address}/route", data, timeout, secret)
            break
        except OSError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.2)
    if status != 200:
        raise RuntimeError(f"bootstrap server {address} refused the registration: {body!r}")
    return json.loads(body)["registration_id"]


def query_route(address: str, ranks: tuple[int, int, int, int], secret: str | None,
                timeout: float = 2.0) -> dict:  # fmt: skip
    """`GET /route`; raises OSError when unreachable, RuntimeError on a non-200 answer."""
    query = "&".join(f"{k}={v}" for k, v in zip(RANK_KEYS, ranks))
    status, body = _request("GET", f"http://{address}/route?{query}", None, timeout, secret)
    if status != 200:
        raise RuntimeError(f"bootstrap server {address}: {status} {body.decode(errors='replace')}")
    answer = json.loads(body)
    if not isinstance(answer, dict):
        raise ValueError(f"bootstrap server {address}: the answer is not a JSON object")
    return answer


def healthy(address: str, timeout: float = 1.0) -> bool:
    try:
        return _request("GET", f"http://{address}/health", None, timeout)[0] == 200
    except OSError:
        return False
