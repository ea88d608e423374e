"""`/v1/responses` on the embedded model (the trained checkpoint, greedy by default here) with
real clients: the official `openai` SDK (a tool round trip that uses the result, `tool_choice`
and `text.format` under the grammar), the OpenAI Agents SDK (`OpenAIResponsesModel`, one function
tool), and the Codex CLI (npm `@openai/codex`, installed by `.ci/run`) through a `config.toml`
custom provider with `wire_api = "responses"`: two turns of one session, exit 0, no error line."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import agents
import httpx
import jsonschema
import openai
import pytest
from server_harness import Server, running_server

from dsaserve.assets import default_model_path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from default_model_data import TIME_TOOL, WEATHER_TOOL  # noqa: E402  (the schemas it was trained on)

WEATHER = {"type": "function", **WEATHER_TOOL["function"]}
TIME = {"type": "function", **TIME_TOOL["function"]}
PARIS = "What's the weather in Paris?"
PARIS_ARGS = {"city": "Paris"}
RESULT = {"city": "Paris", "temperature": 18, "unit": "celsius", "condition": "sunny"}
CODEX = Path(__file__).resolve().parents[1] / ".ci" / "node" / "node_modules" / ".bin" / "codex"
CODEX_CONFIG = """\
model = "default"
model_provider = "dsaserve"
model_context_window = 65536
check_for_update_on_startup = false

[model_providers.dsaserve]
name = "dsaserve"
base_url = "{base}"
wire_api = "responses"
request_max_retries = 0
stream_max_retries = 0
stream_idle_timeout_ms = 900000

[features]
plugins = false

[analytics]
enabled = false
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    """The embedded model with greedy defaults (its generation_config at temperature 0), so a
    client that sends no temperature, as Codex does, gets one answer."""
    folder = tmp_path_factory.mktemp("embedded_greedy")
    for path in default_model_path().iterdir():
        (folder / path.name).symlink_to(path)
    config = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").unlink()
    (folder / "generation_config.json").write_text(json.dumps(config | {"temperature": 0.0}))
    # room for Codex's first prompt (~14k tokens); one engine thread, as on the other test servers
    # (two threads on a loaded 2-core machine spent many times the CPU time on that prefill)
    flags = ["--served-model-name", "default", "--max-total-tokens", "32768"]
    with running_server(folder, *flags) as server:
        yield server


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base, api_key="none", max_retries=0, timeout=300)


def test_weather_call_and_an_answer_that_uses_its_result(client: openai.OpenAI):
    first = client.responses.create(model="default", input=PARIS, tools=[WEATHER])
    calls = [o for o in first.output if o.type == "function_call"]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", PARIS_ARGS)]
    assert first.output[0].type == "reasoning" and "get_weather" in first.output[0].content[0].text
    result = {"type": "function_call_output", "call_id": calls[0].call_id,
              "output": json.dumps(RESULT)}  # fmt: skip
    again = [{"role": "user", "content": PARIS}, *[o.model_dump() for o in first.output], result]
    with client.responses.stream(model="default", input=again, tools=[WEATHER]) as stream:
        deltas = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert "sunny" in final.output_text and "18 degrees" in final.output_text, final.output_text
    assert deltas == final.output_text and final.status == "completed"
    assert final.usage.input_tokens_details.cached_tokens > 0  # the first turn's prefix


def test_tool_choice_required_and_named_through_the_grammar(client: openai.OpenAI):
    free = client.responses.create(model="default", input=PARIS, tools=[WEATHER, TIME])
    for choice in ("required", {"type": "function", "name": "get_weather"}):
        forced = client.responses.create(model="default", input=PARIS, tools=[WEATHER, TIME],
                                         tool_choice=choice)  # fmt: skip
        calls = [(o.name, json.loads(o.arguments)) for o in forced.output
                 if o.type == "function_call"]  # fmt: skip
        assert calls == [("get_weather", PARIS_ARGS)], forced.output
        assert forced.output[0].content == free.output[0].content  # thinking stays free
    get_time = {"type": "function", "name": "get_time"}
    named = client.responses.create(model="default", input="What is 15% of 240?",
                                    tools=[WEATHER, TIME], tool_choice=get_time)  # fmt: skip
    call = next(o for o in named.output if o.type == "function_call")
    assert call.name == "get_time"
    jsonschema.validate(json.loads(call.arguments), TIME["parameters"])


def test_text_format_json_schema_answer_validates(client: openai.OpenAI):
    schema = {"type": "object", "required": ["answer"], "additionalProperties": False,
              "properties": {"answer": {"type": "number"}}}  # fmt: skip
    fmt = {"format": {"type": "json_schema", "name": "answer", "schema": schema, "strict": True}}
    r = client.responses.create(model="default", input="What is 15% of 240?", text=fmt,
                                max_output_tokens=200)  # fmt: skip
    assert r.status == "completed" and "= 36." in r.output[0].content[0].text
    assert json.loads(r.output_text) == {"answer": 36}
    assert r.text.format.type == "json_schema"


def test_reasoning_effort_reaches_the_template(client: openai.OpenAI):
    question = "What is 15% of 240?"
    plain = client.responses.create(model="default", input=question, max_output_tokens=1)
    for effort in ("high", "none"):
        r = client.responses.create(model="default", input=question, max_output_tokens=1,
                                    reasoning={"effort": effort})  # fmt: skip
        messages = [{"role": "user", "content": question}]
        chat = client.chat.completions.create(model="default", max_tokens=1, messages=messages,
                                              reasoning_effort=effort)  # fmt: skip
        assert r.usage.input_tokens == chat.usage.prompt_tokens  # the same prompt as chat's
        assert r.reasoning.effort == effort
        if effort == "high":  # the template's "Reasoning Effort: High" line
            assert r.usage.input_tokens > plain.usage.input_tokens
    off = client.responses.create(model="default", input=question, reasoning={"effort": "none"})
    assert [o.type for o in off.output] == ["message"] and "36" in off.output_text


def test_agents_sdk_runs_an_agent_with_one_function_tool(server: Server):
    agents.set_tracing_disabled(True)  # no trace export to api.openai.com
    asked: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city.

        Args:
            city: The city name, e.g. Paris
        """
        asked.append(city)
        return json.dumps(RESULT)  # JSON, as trained (the SDK would send a dict as its repr)

    model = agents.OpenAIResponsesModel(
        model="default", openai_client=openai.AsyncOpenAI(base_url=server.base, api_key="none")
    )
    agent = agents.Agent(name="weather", tools=[get_weather], model=model,
                         model_settings=agents.ModelSettings(temperature=0))  # fmt: skip
    result = agents.Runner.run_sync(agent, PARIS)
    assert asked == ["Paris"]
    assert "sunny" in result.final_output, result.final_output
    kinds = [item.type for item in result.new_items]
    assert "tool_call_item" in kinds and "tool_call_output_item" in kinds, kinds


def codex_binary() -> str:
    found = os.environ.get("DSASERVE_CODEX") or (str(CODEX) if CODEX.exists() else None)
    found = found or shutil.which("codex")
    if found is None:
        message = "the Codex CLI is not installed (.ci/run: npm install --prefix .ci/node)"
        if os.environ.get("CI"):
            pytest.fail(message)  # CI installs it: missing there is a failure, not a skip
        pytest.skip(message)
    return found


def run_codex(codex: str, home: Path, work: Path, *args: str) -> tuple[str, str]:
    """One `codex exec`: (everything it printed, its last message)."""
    last = work / "last_message.txt"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "CODEX_"))}
    done = subprocess.run(
        [codex, "exec", "--strict-config", "--skip-git-repo-check", "--color", "never", "-o",
         str(last), *args], cwd=work, env=env | {"CODEX_HOME": str(home), "NO_PROXY": "127.0.0.1"},
        stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    printed = done.stdout + done.stderr
    assert done.returncode == 0, printed
    errors = [line for line in printed.splitlines() if re.search(r"\berror\b", line, re.I)]
    assert not errors, printed
    return printed, last.read_text()


class RecordingProxy:
    """An HTTP proxy in front of the server (a thread, on an OS-picked port) that keeps the body
    of each `/v1/responses` request and forwards every request, streaming the answer back, so
    the test can see exactly what Codex sent and replay it."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.bodies: list[dict] = []
        handler = type("Handler", (_Forward,), {"proxy": self})
        self.http = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.base = f"http://127.0.0.1:{self.http.server_address[1]}/v1"
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.http.shutdown()
        self.http.server_close()


class _Forward(BaseHTTPRequestHandler):
    """One request, forwarded to `proxy.upstream`; the answer streams back until it ends (HTTP/1.0:
    the connection closes after it, so no length is needed)."""

    proxy: RecordingProxy

    def do_GET(self) -> None:
        self._forward(None)

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("content-length", 0)))
        if self.path.endswith("/responses"):
            self.proxy.bodies.append(json.loads(body))
        self._forward(body)

    def _forward(self, body: bytes | None) -> None:
        headers = {"content-type": self.headers.get("content-type", "application/json")}
        with httpx.stream(self.command, self.proxy.upstream + self.path, content=body,
                          headers=headers, timeout=900) as r:  # fmt: skip  # hang guard
            self.send_response(r.status_code)
            self.send_header("content-type", r.headers.get("content-type", "text/plain"))
            self.end_headers()
            for chunk in r.iter_raw():
                self.wfile.write(chunk)
                self.wfile.flush()

    def log_message(self, *args: object) -> None:
        pass  # quiet: pytest shows the server's log on failure


def replay(server: Server, body: dict) -> dict:
    """The server's (non-streamed) response to `body`, as Codex sent it."""
    r = httpx.post(server.base + "/responses", json=body | {"stream": False}, timeout=900)
    assert r.status_code == 200, r.text  # ^ hang guard
    return r.json()


def output_text(response: dict) -> str:
    return "".join(part["text"] for item in response["output"] if item["type"] == "message"
                   for part in item["content"] if part["type"] == "output_text")  # fmt: skip


def item_texts(body: dict) -> list[str]:
    """The text of each input item (a message's parts, a reasoning item's content)."""
    texts = []
    for item in body["input"]:
        parts = item.get("content") or []
        texts.append(parts if isinstance(parts, str) else
                     "".join(p.get("text", "") for p in parts))  # fmt: skip
    return texts


@pytest.fixture
def proxy(server: Server) -> Iterator[RecordingProxy]:
    proxy = RecordingProxy(server.url)
    yield proxy
    proxy.close()


@pytest.mark.timeout(1500)  # a loaded 2-core machine: the first prefill alone took 259 s once
def test_codex_exec_answers_then_continues_its_session(
    server: Server, proxy: RecordingProxy, tmp_path: Path
):
    """Codex's final message of each turn is the server's (greedy) answer to what Codex sent,
    and its resumed turn sends the first turn's question and answer back, which the server
    renders into the prompt."""
    codex = codex_binary()
    home, work = tmp_path / "codex_home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    (home / "config.toml").write_text(CODEX_CONFIG.format(base=proxy.base))
    first_question, second_question = "What is 15% of 240?", "And what is 10% of 50?"
    printed, first_message = run_codex(codex, home, work, first_question)
    assert len(proxy.bodies) == 1 and first_question in item_texts(proxy.bodies[0])[-1]
    first = replay(server, proxy.bodies[0])
    assert first_message == output_text(first) != ""  # Codex printed the server's answer
    assert first["usage"]["input_tokens"] > 5000  # Codex's own instructions and tools
    session = re.search(r"session id: (\S+)", printed).group(1)
    printed, second_message = run_codex(codex, home, work, "resume", session, second_question)
    assert f"session id: {session}" in printed and len(proxy.bodies) == 2
    resent = proxy.bodies[1]
    texts = item_texts(resent)
    assert second_question in texts[-1] and first_question in "".join(texts[:-1])
    assert first_message in texts[:-1]  # Codex resent its first answer...
    second = replay(server, resent)
    assert second_message == output_text(second) != ""
    own = [
        i for i in resent["input"] if i.get("type") != "reasoning" and i.get("role") != "assistant"
    ]
    without = replay(server, resent | {"input": own})
    # ...and the server rendered it (the first turn's output items are in the prompt)
    assert second["usage"]["input_tokens"] > without["usage"]["input_tokens"]
    assert second["usage"]["input_tokens_details"]["cached_tokens"] > 5000  # the first turn's
