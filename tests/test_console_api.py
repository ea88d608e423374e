"""The web console's server side without a browser: `POST /api/plan` answers exactly what
`dsaserve plan --json` prints for every cell of the matrix, refusals and bad input have the right
shapes and statuses, the routes answer while the engine loads, drains or is dead, the page's files
are served, and `dsaserve plan --web` serves them without a model."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient
from server_harness import stop_group

from dsaserve.args import ServerArgs
from dsaserve.deploy.hardware import HARDWARE
from dsaserve.deploy.layout import RECIPES, PlanRequest, Refusal
from dsaserve.deploy.models import BUILTIN_MODELS
from dsaserve.deploy.planner import RULES, plan
from dsaserve.plan_cli import main as plan_main
from dsaserve.server import console
from dsaserve.server.app import build_app
from dsaserve.server.state import ServerState

WEB_URL = re.compile(r"dsaserve console: (http://\S+)/console/")


class DeadEngine:
    dead = "engine process exited"

    def in_flight_rids(self) -> list[str]:
        return []


def client(ready: bool = True, draining: bool = False, engine=None, api_key=None) -> TestClient:
    args = ServerArgs(api_key=api_key)
    state = ServerState(args=args, ready=ready, draining=draining, engine=engine)
    return TestClient(build_app(state))


@pytest.fixture(scope="module")
def api() -> TestClient:
    return client(ready=False)  # the engine is still loading: the planner answers anyway


def cli_json(argv: list[str], capsys) -> tuple[int, dict]:
    code = plan_main([*argv, "--json"])
    return code, json.loads(capsys.readouterr().out)


def test_api_equals_cli_for_every_cell_of_the_matrix(api: TestClient, capsys):
    matrix = api.get("/api/plan/matrix").json()
    cells = matrix["cells"]
    assert len(cells) == len(BUILTIN_MODELS) * len(HARDWARE) * len(RECIPES) * 4
    assert {c["ok"] for c in cells} == {True, False}
    for cell in cells:
        fields = {k: cell[k] for k in ("model", "hardware", "recipe", "nodes")}
        argv = [f"--{k}={v}" for k, v in fields.items() if v is not None]
        code, printed = cli_json(argv, capsys)
        answer = api.post("/api/plan", json=fields)
        assert answer.status_code == 200, fields
        assert answer.json() == printed, fields
        assert (code == 0) == cell["ok"] == printed["ok"], fields
        if not cell["ok"]:
            assert (cell["rule"], cell["reason"]) == (printed["rule"], printed["reason"])


def test_api_equals_cli_with_feature_options(api: TestClient, capsys):
    fields = {"model": "GLM-5.3", "hardware": "H200", "recipe": "balanced", "pd": "prefill",
              "pd_transfer_backend": "nixl", "hicache": True, "hicache_write_policy": "write_back",
              "hicache_storage": "file", "dp_attention": "off", "reasoning_parser": False,
              "kv_cache_dtype": "fp8_e4m3", "input_len": 4096, "output_len": 512,
              "mem_fraction_static": 0.78}  # fmt: skip
    code, printed = cli_json(PlanRequest(**fields).to_argv(), capsys)
    body = api.post("/api/plan", json=fields).json()
    assert code == 0 and body == printed
    [serve, router] = body["commands"]
    for flag in ("--disaggregation-transfer-backend nixl", "--hicache-write-policy write_back",
                 "--hicache-storage-backend file", "--mem-fraction-static 0.78"):  # fmt: skip
        assert flag in serve["dsaserve"] and flag in serve["sglang"]
    assert "--enable-dp-attention" not in serve["dsaserve"]
    assert "--reasoning-parser" not in serve["dsaserve"] and "--tool-call-parser" in serve["sglang"]
    assert router["role"] == "router"
    assert body["request"] == dataclasses.asdict(PlanRequest(**fields))


def test_refusal_shape(api: TestClient):
    r = api.post("/api/plan", json={"model": "GLM-5.3-BF16", "hardware": "H200", "nodes": 1})
    body = r.json()
    assert r.status_code == 200 and body["ok"] is False
    assert body["rule"] == "weights-fit" and "BF16 weights need" in body["reason"]
    near = body["nearest"]
    assert near["ok"] is True and near["request"]["nodes"] == 2 and near["layout"]["tp"] == 16
    assert near["plan"] == (
        "dsaserve plan --model GLM-5.3-BF16 --hardware H200 --recipe low-latency --nodes 2"
    )
    assert [c["node_rank"] for c in near["commands"]] == [0, 1]


@pytest.mark.parametrize(
    "body, status, param",
    [
        ({"nodes": "two"}, 400, "nodes"),
        ({"nodes": True}, 400, "nodes"),
        ({"input_len": 0}, 400, "input_len"),
        ({"mem_fraction_static": 1.5}, 400, "mem_fraction_static"),
        ({"hardware": "TPU"}, 400, "hardware"),
        ({"model": "Llama-3"}, 400, "model"),
        ({"recipe": "fastest"}, 400, "recipe"),
        ({"hicache_storage": "tape"}, 400, "hicache_storage"),
        ({"bogus": 1}, 400, "bogus"),
    ],
)
def test_bad_input_is_a_400_naming_the_field(api: TestClient, body, status, param):
    r = api.post("/api/plan", json=body)
    error = r.json()["error"]
    assert r.status_code == status and r.json()["ok"] is False
    assert error["type"] == "BadRequestError" and error["param"] == param and error["message"]


def test_bad_bodies(api: TestClient):
    r = api.post("/api/plan", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "malformed JSON" in r.json()["error"]["message"]
    assert api.post("/api/plan", json=[1, 2]).status_code == 400
    assert api.post("/api/plan", content=b" " * (65 * 1024)).status_code == 413
    r = api.get("/api/plan/matrix", params={"input_len": "many"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input_len"
    assert api.get("/api/plan/matrix", params={"nope": "1"}).json()["error"]["param"] == "nope"
    assert api.get("/api/plan/matrix", params={"speculative": "x"}).status_code == 400


def test_deep_json_is_a_400_in_the_planners_shape(api: TestClient):
    for body in (b"[" * 2000 + b"]" * 2000, b'{"a": ' * 100 + b"1" + b"}" * 100):
        r = api.post("/api/plan", content=body, headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["ok"] is False
        assert "nested deeper" in r.json()["error"]["message"]


def test_matrix_is_computed_once_per_query(api: TestClient, monkeypatch):
    calls = []
    monkeypatch.setattr(console, "plan_matrix", lambda fixed: calls.append(fixed) or {"n": 1})
    query = {"speculative": "none", "input_len": "4321"}  # a query no other test asks
    threads = [threading.Thread(target=api.get, args=("/api/plan/matrix",), kwargs={"params":
               query}) for _ in range(16)]  # fmt: skip
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert api.get("/api/plan/matrix", params=query).json() == {"n": 1}
    assert len(calls) == 1  # 17 calls, one computation
    api.get("/api/plan/matrix", params={**query, "input_len": "4322"})
    assert len(calls) == 2


@pytest.mark.parametrize("path", ["/v1/models", "/v1/models/x", "/get_server_info",
                                  "/get_model_info", "/model_info", "/get_load", "/health",
                                  "/v1/completions", "/flush_cache"])  # fmt: skip
def test_every_route_is_a_503_in_the_apis_shape_while_starting(path: str):
    c = client(ready=False)
    r = c.post(path, json={"prompt": "x"}) if path == "/v1/completions" else c.get(path)
    assert r.status_code == 503 and r.headers["retry-after"] == "5"
    if path != "/health":
        assert r.json()["error"]["type"] == "ServiceUnavailableError"
    info = client(engine=DeadEngine()).get("/get_server_info")  # started, then died: it answers
    assert info.status_code == 200 and info.json()["cluster_secret"] is None


def test_cli_json_bad_input_prints_the_same_envelope(api: TestClient, capsys):
    assert plan_main(["--input-len", "0", "--json"]) == 2
    captured = capsys.readouterr()
    assert "--input-len must be >= 1" in captured.err
    assert json.loads(captured.out) == api.post("/api/plan", json={"input_len": 0}).json()


def test_matrix_cells_follow_the_planner_and_the_fixed_options(api: TestClient):
    fixed = {"speculative": "dflash2", "kv_cache_dtype": "fp8_e4m3", "hicache": "false"}
    matrix = api.get("/api/plan/matrix", params=fixed).json()
    assert matrix["fixed"] == {"speculative": "dflash2", "kv_cache_dtype": "fp8_e4m3",
                               "hicache": False}  # fmt: skip
    for cell in matrix["cells"][::7]:
        request = PlanRequest(model=cell["model"], hardware=cell["hardware"],
                              recipe=cell["recipe"], nodes=cell["nodes"], speculative="dflash2",
                              kv_cache_dtype="fp8_e4m3", hicache=False)  # fmt: skip
        try:
            done = plan(request)
            assert cell["ok"] and cell["nodes_planned"] == done.layout.nodes
        except Refusal as refusal:
            assert not cell["ok"]
            assert (cell["rule"], cell["reason"]) == (refusal.rule, refusal.reason)
    refused = {c["rule"] for c in matrix["cells"] if not c["ok"]}
    assert {"dflash2-no-dp-attention", "fp8-kv-nvidia-only"} <= refused


def test_options_come_from_the_planner_tables(api: TestClient):
    options = api.get("/api/plan/options").json()
    assert [m["name"] for m in options["models"]] == list(BUILTIN_MODELS)
    by_name = {m["name"]: m for m in options["models"]}
    assert by_name["GLM-5.3-BF16"]["base"] == "GLM-5.3" and by_name["GLM-5.3-BF16"]["precision"]
    assert {hw["name"]: hw["memory_gib"] for hw in options["hardware"]} == {
        name: hw.memory_gib for name, hw in HARDWARE.items()
    }
    assert options["recipes"] == list(RECIPES)
    assert [r["name"] for r in options["rules"]] == [r.name for r in RULES]
    assert options["defaults"] == dataclasses.asdict(PlanRequest())
    choices = options["choices"]
    assert choices["pd_transfer_backend"] == ["auto", "mooncake", "nixl"]
    assert "write_back" in choices["hicache_write_policy"] and "dflash2" in choices["speculative"]


@pytest.mark.parametrize(
    "kwargs",
    [{"ready": False}, {"draining": True}, {"engine": DeadEngine()}],
    ids=["loading", "draining", "dead"],
)
def test_planner_and_page_answer_whatever_the_engine_does(kwargs):
    c = client(**kwargs)
    assert c.post("/v1/chat/completions", json={"messages": []}).status_code == 503
    assert c.get("/api/plan/options").status_code == 200
    assert c.post("/api/plan", json={"recipe": "balanced"}).json()["ok"] is True
    assert c.get("/api/plan/matrix").status_code == 200
    assert c.get("/console/").status_code == 200


def test_page_files_and_headers():
    c = client(api_key="sk-k")
    page = c.get("/console/")
    assert page.headers["content-type"].startswith("text/html")
    assert "default-src 'self'" in page.headers["content-security-policy"]
    assert '<script type="module" src="/console/console.js">' in page.text
    assert c.get("/console", follow_redirects=False).headers["location"] == "/console/"
    js = c.get("/console/console.js")
    assert js.headers["content-type"].startswith("text/javascript") and "fetch(" in js.text
    assert c.get("/console/console.css").headers["content-type"].startswith("text/css")
    assert c.get("/console/secrets.txt").status_code == 404
    assert c.get("/console/config.json").json()["api_key_required"] is True
    assert c.get("/v1/models").status_code == 401  # the API keeps its key
    assert c.post("/api/plan", json={}).status_code == 200  # the planner needs none


def test_page_uses_no_outside_resource_and_no_html_sinks():
    folder = Path(__file__).resolve().parent.parent / "dsaserve" / "assets" / "console"
    assert sorted(p.name for p in folder.iterdir()) == ["console.css", "console.js", "index.html"]
    for path in folder.iterdir():
        text = path.read_text()
        assert "http://" not in text and "https://" not in text, path.name
        for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval("):
            assert sink not in text, (path.name, sink)


@contextlib.contextmanager
def running_plan_web() -> Iterator[str]:
    """`dsaserve plan --web --port 0`; yields its base URL and always stops its process group."""
    command = [sys.executable, "-m", "dsaserve.cli", "plan", "--web", "--port", "0"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, start_new_session=True)  # fmt: skip
    try:
        found: list[str] = []
        ready = threading.Event()

        def pump() -> None:
            for line in process.stdout:
                match = WEB_URL.search(line)
                if match and not found:
                    found.append(match.group(1))
                    ready.set()
            ready.set()

        threading.Thread(target=pump, daemon=True).start()
        assert ready.wait(60) and found, "plan --web did not start"
        yield found[0]
    finally:
        stop_group(process)


def test_plan_web_serves_the_console_without_a_model():
    with running_plan_web() as url:
        assert url.startswith("http://127.0.0.1:")  # loopback unless --host says otherwise
        assert httpx.get(url + "/console/config.json").json()["chat"] is False
        assert "Deploy" in httpx.get(url + "/console/").text
        body = httpx.post(url + "/api/plan", json={"recipe": "balanced"}).json()
        assert "--enable-dp-attention" in body["commands"][0]["dsaserve"]
        assert httpx.get(url + "/v1/models").status_code == 404  # no model here
