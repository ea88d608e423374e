"""A Hugging Face Hub stand-in on loopback: the three routes `huggingface_hub.snapshot_download`
(2.4) asks, serving local folders under repo ids (/work/shared/reference/hub.md).

- `GET /api/models/{org}/{name}/revision/{rev}`: `id`, `sha` (the commit), `siblings`;
- `GET /api/models/{org}/{name}/tree/{rev}`: the files, `type`/`path`/`size`/`oid`, one page;
- `HEAD` / `GET /{org}/{name}/resolve/{rev}/{file}`: the bytes, with `X-Repo-Commit`, `ETag`,
  `Content-Length`.

An unknown repo is 404 `RepoNotFound`; a repo in `private` without the token is 401; an unknown
revision 404 `RevisionNotFound`; an unknown file 404 `EntryNotFound`. Every request is recorded
(`requests`: method and path) so a test can say what was and was not fetched; a file in `gates`
is sent only once its event is set (a download held in flight).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

TOKEN = "hf_standin_token"
GATE_GUARD_S = 120.0


class HubStandIn:
    """Repos (id -> folder), each at one commit; `url` is what HF_ENDPOINT should be."""

    def __init__(self, repos: dict[str, Path], private: tuple[str, ...] = ()) -> None:
        self.repos = repos
        self.private = private
        self.requests: list[tuple[str, str]] = []
        self.gates: dict[str, threading.Event] = {}  # file -> its bytes wait until set
        self.sha = {repo: hashlib.sha1(repo.encode()).hexdigest() for repo in repos}
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def files(self, repo: str) -> list[str]:
        root = self.repos[repo]
        return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())

    def fetched(self) -> set[str]:
        """The files whose bytes were asked for (GET on a resolve route)."""
        return {p.split("/resolve/", 1)[1].split("/", 1)[1] for m, p in self.requests
                if m == "GET" and "/resolve/" in p}  # fmt: skip

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_HEAD(self) -> None:
                hub._answer(self, body=False)

            def do_GET(self) -> None:
                hub._answer(self, body=True)

        return Handler

    def _answer(self, h: BaseHTTPRequestHandler, body: bool) -> None:
        path = unquote(urlsplit(h.path).path)
        self.requests.append((h.command, path))
        api = path.startswith("/api/models/")
        parts = path.removeprefix("/api/models/" if api else "/").split("/")
        repo, route, rest = "/".join(parts[:2]), parts[2:3], parts[3:]
        if repo not in self.repos:
            return self._error(h, 404, "RepoNotFound")
        if repo in self.private and h.headers.get("Authorization") != f"Bearer {TOKEN}":
            return self._error(h, 401, "RepoNotFound")
        if not rest or rest[0] not in ("main", self.sha[repo]):
            return self._error(h, 404, "RevisionNotFound")
        if api and route == ["revision"]:
            siblings = [{"rfilename": f} for f in self.files(repo)]
            return self._json(h, {"id": repo, "sha": self.sha[repo], "siblings": siblings,
                                  "private": repo in self.private})  # fmt: skip
        if api and route == ["tree"]:
            return self._json(h, [self._entry(repo, f) for f in self.files(repo)])
        if not api and route == ["resolve"]:
            return self._file(h, repo, "/".join(rest[1:]), body)
        return self._error(h, 404, "EntryNotFound")

    def _entry(self, repo: str, name: str) -> dict:
        data = (self.repos[repo] / name).read_bytes()
        return {"type": "file", "path": name, "size": len(data),
                "oid": hashlib.sha1(data).hexdigest()}  # fmt: skip

    def _file(self, h: BaseHTTPRequestHandler, repo: str, name: str, body: bool) -> None:
        file = self.repos[repo] / name
        if not name or not file.is_file():
            return self._error(h, 404, "EntryNotFound")
        data = file.read_bytes()
        if body and name in self.gates:
            self.gates[name].wait(GATE_GUARD_S)  # hang guard
        h.send_response(200)
        h.send_header("X-Repo-Commit", self.sha[repo])
        h.send_header("ETag", f'"{hashlib.sha256(data).hexdigest()}"')
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        if body:
            h.wfile.write(data)

    def _json(self, h: BaseHTTPRequestHandler, value: object) -> None:
        data = json.dumps(value).encode()
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        if h.command == "GET":
            h.wfile.write(data)

    def _error(self, h: BaseHTTPRequestHandler, status: int, code: str) -> None:
        data = json.dumps({"error": code}).encode()
        h.send_response(status)
        h.send_header("X-Error-Code", code)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        if h.command == "GET":
            h.wfile.write(data)


@contextlib.contextmanager
def running_hub(repos: dict[str, Path], private: tuple[str, ...] = ()) -> Iterator[HubStandIn]:
    """The stand-in, serving until the block exits (then its port is closed)."""
    hub = HubStandIn(repos, private)
    hub.thread.start()
    try:
        yield hub
    finally:
        hub.server.shutdown()
        hub.server.server_close()


def hub_env(environ: dict, endpoint: str, home: Path, offline: bool = False) -> dict:
    """`environ` pointed at the stand-in with its own (empty at first) HF_HOME, nothing else of
    the Hub's: no token, no other cache, online unless `offline`."""
    keep = {k: v for k, v in environ.items()
            if not k.startswith(("HF_", "HUGGINGFACE_"))}  # fmt: skip
    env = {**keep, "HF_ENDPOINT": endpoint, "HF_HOME": str(home),
           "HF_HUB_DISABLE_TELEMETRY": "1"}  # fmt: skip
    if offline:
        env["HF_HUB_OFFLINE"] = "1"
    return env
