"""The prefill's bootstrap server (SGLang's `--disaggregation-bootstrap-port`) and its client.

- `PUT /route`: a prefill rank registers `{attn_tp_size, attn_tp_rank, attn_cp_size, ...,
  rank_ip, rank_port, page_size, kv_cache_dtype}` (extra keys are kept and reported).
- `GET /route?prefill_dp_rank=-1&prefill_cp_rank=-1&target_tp_rank=-1&target_pp_rank=-1`: the
  server's layout (503 until every rank registered); with real ranks: that rank's
  `{rank_ip, rank_port}` (404 when unknown).
- `GET /health`: the decode's heartbeat.
"""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

RANK_KEYS = ("prefill_dp_rank", "prefill_cp_rank", "target_tp_rank", "target_pp_rank")


class BootstrapServer:
    """A threaded HTTP server holding the prefill ranks' registrations."""

    def __init__(self, host: str, port: int) -> None:
        self.ranks: dict[tuple[int, int, int, int], dict] = {}
        self.info: dict = {}
        self.lock = threading.Lock()
        self.httpd = ThreadingHTTPServer((host, port), _handler(self))
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def register(self, data: dict) -> None:
        key = (int(data["attn_dp_rank"]), int(data["attn_cp_rank"]), int(data["attn_tp_rank"]),
               int(data["pp_rank"]))  # fmt: skip
        with self.lock:
            self.ranks[key] = {"rank_ip": data["rank_ip"], "rank_port": int(data["rank_port"])}
            if not self.info:
                self.info = {
                    "attn_tp_size": int(data["attn_tp_size"]),
                    "attn_cp_size": int(data["attn_cp_size"]),
                    "dp_size": int(data["attn_dp_size"]),
                    "pp_size": int(data["pp_size"]),
                    "page_size": int(data["page_size"]),
                    "kv_cache_dtype": data.get("kv_cache_dtype"),
                    "follow_bootstrap_room": True,
                    **{k: v for k, v in data.items() if k.startswith("dsaserve_")},
                }

    def ready(self) -> bool:
        info = self.info
        if not info:
            return False
        expected = info["attn_tp_size"] * info["attn_cp_size"] * info["dp_size"] * info["pp_size"]
        return len(self.ranks) >= expected

    def route(self, query: dict[str, list[str]]) -> tuple[int, dict | str]:
        try:
            ranks = tuple(int(query[k][0]) for k in RANK_KEYS)
        except (KeyError, ValueError):
            return 400, "Missing inputs for bootstrap server."
        if not self.ready():
            return 503, f"Prefill server not fully registered yet ({len(self.ranks)} registered)."
        if ranks == (-1, -1, -1, -1):
            return 200, self.info
        with self.lock:
            found = self.ranks.get(ranks)
        return (200, found) if found else (404, f"Bootstrap info not found for {ranks}")


def _handler(server: BootstrapServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:  # quiet
            pass

        def _reply(self, status: int, body: dict | str) -> None:
            data = (json.dumps(body) if isinstance(body, dict) else body).encode()
            self.send_response(status)
            kind = "application/json" if isinstance(body, dict) else "text/plain"
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:  # noqa: N802
            url = urlparse(self.path)
            if url.path == "/health":
                self._reply(200, "OK")
            elif url.path == "/route":
                self._reply(*server.route(parse_qs(url.query)))
            else:
                self._reply(404, "not found")

        def do_PUT(self) -> None:  # noqa: N802
            if urlparse(self.path).path != "/route":
                return self._reply(404, "not found")
            try:
                length = int(self.headers.get("Content-Length", 0))
                server.register(json.loads(self.rfile.read(length)))
            except (ValueError, KeyError, TypeError) as e:
                return self._reply(400, f"bad registration: {e}")
            self._reply(200, "OK")

    return Handler


# ---- the client side (prefill ranks register; decodes look up and send heartbeats) ----------
def _request(method: str, url: str, body: dict | None, timeout: float) -> tuple[int, bytes]:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, method=method)
    request.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def register_rank(address: str, data: dict, timeout: float = 5.0) -> None:
    status, body = _request("PUT", f"http://{address}/route", data, timeout)
    if status != 200:
        raise RuntimeError(f"bootstrap server {address} refused the registration: {body!r}")


def query_route(address: str, ranks: tuple[int, int, int, int], timeout: float = 2.0) -> dict:
    """`GET /route`; raises OSError when unreachable, RuntimeError on a non-200 answer."""
    query = "&".join(f"{k}={v}" for k, v in zip(RANK_KEYS, ranks))
    status, body = _request("GET", f"http://{address}/route?{query}", None, timeout)
    if status != 200:
        raise RuntimeError(f"bootstrap server {address}: {status} {body.decode(errors='replace')}")
    return json.loads(body)


def healthy(address: str, timeout: float = 1.0) -> bool:
    try:
        return _request("GET", f"http://{address}/health", None, timeout)[0] == 200
    except OSError:
        return False
