"""The web console in headless Chromium: Debian's `chromium`, driven by Playwright through
`executable_path` (no browser download), one launch for the module.

The Playground runs against `dsaserve serve` with the scripted engine, whose `[[script:KEY]]`
prompts stream reasoning and tool calls deterministically (the Deploy panel, against `dsaserve plan
--web`, is test_console_deploy.py's, with this module's browser and page). Every page fails its
test on a page error, a console error, or a request to anything but the loopback. The browser is
found by tests/chromium.py (Debian's, or Playwright's own); without one the module skips, which
fails CI (tests/skip_policy.py). Screenshots of
both panels go to docs/images/ in CI or with `DSASERVE_UPDATE_SCREENSHOTS=1` (elsewhere to a
temporary folder, so test runs leave the checkout clean).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlparse

import httpx
import pytest
from chromium import find_chromium
from server_harness import Server, running_server, wait_for, write_scripts

IN_CI = os.environ.get("CI") == "true"
LOOPBACK = ("127.0.0.1", "localhost", "::1", "[::1]")
IMAGES = Path(__file__).resolve().parent.parent / "docs" / "images"
WAIT_MS = 60_000  # hang guard: every wait for the page (playwright expect, selectors)
REASONING = "The user asks for the weather in Beijing, so I call the weather tool for three days."
ANSWER = "It will be sunny in Beijing for the next three days."
SCRIPTS = {
    "weather": {"text": REASONING + "</think>Let me check.<tool_call>get_weather<arg_key>location"
                "</arg_key><arg_value>Beijing</arg_value><arg_key>days</arg_key><arg_value>3"
                "</arg_value></tool_call>", "chunk": 2, "delay": 0.03},
    "sunny": {"text": "The tool answered.</think>" + ANSWER, "chunk": 2, "delay": 0.02},
    "nothink": {"text": "Just the answer, no thinking.", "chunk": 4},
    "slow": {"text": "</think>" + "tick " * 2000, "chunk": 1, "delay": 0.05},
    "html": {"text": "</think><b>bold</b><img src=x onerror=alert(1)>", "chunk": 8},
}  # fmt: skip


@pytest.fixture(scope="module")
def browser() -> Iterator:
    try:
        from playwright.sync_api import expect, sync_playwright
    except ImportError:
        pytest.skip("playwright is not installed (scripts/install.sh)")
    executable = find_chromium()
    if executable is None:
        pytest.skip("no Chromium: scripts/install.sh installs Debian's (or: playwright install "
                    "chromium)")  # fmt: skip
    expect.set_options(timeout=WAIT_MS)
    with sync_playwright() as driver:
        chromium = driver.chromium.launch(executable_path=executable, args=["--no-sandbox"])
        try:
            yield chromium
        finally:
            chromium.close()


@pytest.fixture(scope="module")
def shots(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if IN_CI or os.environ.get("DSASERVE_UPDATE_SCREENSHOTS"):
        IMAGES.mkdir(parents=True, exist_ok=True)
        return IMAGES
    return tmp_path_factory.mktemp("screenshots")


@pytest.fixture(scope="module")
def chat_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    scripts = write_scripts(tmp_path_factory.mktemp("console_scripts"), SCRIPTS)
    flags = ["--enable-metrics", "--enable-cache-report", "--served-model-name", "glm-console"]
    # the embedded model's tokenizer, no weights run
    with running_server(None, *flags, scripts=scripts, real_engine=False) as server:
        yield server


class Guard:
    """Collects page errors, console errors and requests that leave the loopback."""

    def __init__(self) -> None:
        self.errors: list[str] = []
        self.outside: list[str] = []
        self.http_errors_expected = False

    def on_console(self, message) -> None:
        if message.type != "error":
            return
        failed_load = message.text.startswith("Failed to load resource: the server responded")
        if not (failed_load and self.http_errors_expected):
            self.errors.append(message.text)

    def on_route(self, route) -> None:
        url = urlparse(route.request.url)
        if url.scheme in ("data", "blob") or url.hostname in LOOPBACK:
            route.continue_()
        else:
            self.outside.append(route.request.url)
            route.abort()


@pytest.fixture
def page(browser) -> Iterator:
    guard = Guard()
    context = browser.new_context(viewport={"width": 1280, "height": 860})
    context.grant_permissions(["clipboard-read", "clipboard-write"])
    context.route("**/*", guard.on_route)
    tab = context.new_page()
    tab.on("console", guard.on_console)
    tab.on("pageerror", lambda error: guard.errors.append(f"page error: {error}"))
    tab.guard = guard
    try:
        yield tab
        tab.wait_for_timeout(100)  # late console messages
        assert guard.errors == [], guard.errors
        assert guard.outside == [], guard.outside
    finally:
        context.close()


def open_console(page, base: str, fragment: str = "") -> None:
    page.goto(f"{base}/console/{fragment}")
    page.wait_for_selector("body[data-ready=true]", timeout=WAIT_MS)


def screenshot(page, path: Path) -> None:
    page.screenshot(path=str(path), full_page=True)
    assert 20_000 < path.stat().st_size < 400_000, path.stat().st_size  # a page, and small


# ---------------------------------------------------------------- the Playground


def request_body(request) -> dict:
    return json.loads(request.post_data)


def test_chat_streams_reasoning_and_a_tool_call_and_sends_the_result(page, chat_server, shots):
    from playwright.sync_api import expect

    open_console(page, chat_server.url, "#playground")
    expect(page.locator("#status-strip [data-key=model]")).to_contain_text("glm-console")
    expect(page.locator("#status-strip [data-key=parsers]")).to_contain_text("glm45 · glm47")
    page.click("#k-tools-sample")
    page.fill("#prompt", "What is the weather in Beijing? [[script:weather]]")
    with page.expect_request("**/v1/chat/completions") as sent:
        page.click("#send")
    body = request_body(sent.value)
    assert body["stream"] is True and body["tools"][0]["function"]["name"] == "get_weather"
    assert body["chat_template_kwargs"] == {"enable_thinking": True}
    # streamed: reasoning shows up while the answer is still coming
    page.wait_for_function(
        "() => { const m = document.querySelector('.msg.assistant');"
        " return m && m.dataset.state === 'streaming'"
        " && m.querySelector('.reasoning-text').textContent.length > 0; }",
        timeout=WAIT_MS,
    )
    turn = page.locator(".msg.assistant").first
    expect(turn).to_have_attribute("data-state", "tool_calls")
    assert turn.locator(".reasoning").evaluate("d => d.open") is False  # collapsed
    assert turn.locator(".reasoning-text").text_content() == REASONING
    expect(turn.locator(".content").first).to_have_text("Let me check.")
    card = turn.locator(".tool-call")
    expect(card.locator(".tool-name")).to_have_text("get_weather")
    call_id = card.locator(".tool-id").inner_text()
    assert re.fullmatch(r"call_\w+", call_id)
    assert json.loads(card.locator(".tool-args").inner_text()) == {"location": "Beijing", "days": 3}
    meta = turn.locator(".meta")
    expect(meta.locator("[data-key=finish_reason]")).to_contain_text("tool_calls")
    for key in ("prompt", "completion", "reasoning", "cached", "TTFT", "tok/s"):
        expect(meta.locator(f"[data-key='{key}']")).to_have_count(1)
    assert int(meta.locator("[data-key=reasoning]").inner_text().split()[-1]) > 0
    card.locator(".tool-result").fill('{"forecast": "sunny"} [[script:sunny]]')
    with page.expect_request("**/v1/chat/completions") as sent:
        card.locator(".send-result").click()
    messages = request_body(sent.value)["messages"]
    assert messages[-2]["role"] == "assistant" and messages[-2]["content"] == "Let me check."
    assert messages[-2]["tool_calls"][0]["id"] == call_id
    assert messages[-1] == {"role": "tool", "tool_call_id": call_id,
                            "content": '{"forecast": "sunny"} [[script:sunny]]'}  # fmt: skip
    answer = page.locator(".msg.assistant").nth(1)
    expect(answer).to_have_attribute("data-state", "stop")
    expect(answer.locator(".content").first).to_have_text(ANSWER)
    expect(page.locator("#status-strip [data-key=running]")).to_contain_text("0")
    turn.locator(".reasoning summary").click()  # opened for the picture
    screenshot(page, shots / "console-playground.png")


def test_thinking_toggle_changes_the_request_body(page, chat_server):
    from playwright.sync_api import expect

    open_console(page, chat_server.url, "#playground")
    page.fill("#prompt", "[[script:nothink]]")
    with page.expect_request("**/v1/chat/completions") as sent:
        page.click("#send")
    assert request_body(sent.value)["chat_template_kwargs"] == {"enable_thinking": True}
    first = page.locator(".msg.assistant").first
    expect(first).to_have_attribute("data-state", "stop")
    expect(first.locator(".reasoning-text")).to_have_text("Just the answer, no thinking.")
    page.click("#new-chat")
    page.uncheck("#k-thinking")
    page.check("#k-clear-thinking")
    page.select_option("#k-effort", "high")
    page.fill("#prompt", "[[script:nothink]]")
    preview = json.loads(page.locator("#request-json").text_content())
    assert preview["chat_template_kwargs"] == {"enable_thinking": False, "clear_thinking": True}
    with page.expect_request("**/v1/chat/completions") as sent:
        page.click("#send")
    body = request_body(sent.value)
    assert body == preview
    assert body["reasoning_effort"] == "high"
    turn = page.locator(".msg.assistant").first
    expect(turn).to_have_attribute("data-state", "stop")
    expect(turn.locator(".content").first).to_have_text("Just the answer, no thinking.")
    expect(turn.locator(".reasoning")).to_be_hidden()  # the template closed the think block


def cancelled_count(server: Server) -> float:
    """Requests the client gave up on (Stop ends the fetch: a disconnect)."""
    text = httpx.get(server.url + "/metrics").text
    pattern = r'sglang:num_requests_total\{[^}]*finish_reason="client_cancel"[^}]*\} (\S+)'
    match = re.search(pattern, text)
    return float(match.group(1)) if match else 0.0


def scripted_in_flight(server: Server) -> int:
    info = httpx.get(server.url + "/get_server_info").json()
    return info["internal_states"][0]["num_scripted"]


def test_stop_aborts_the_request_on_the_server(page, chat_server):
    from playwright.sync_api import expect

    open_console(page, chat_server.url, "#playground")
    before = cancelled_count(chat_server)
    page.fill("#prompt", "[[script:slow]]")
    page.click("#send")
    turn = page.locator(".msg.assistant").first
    expect(turn.locator(".content").first).to_contain_text("tick tick")
    assert scripted_in_flight(chat_server) == 1
    expect(page.locator("#status-strip [data-key=running]")).to_contain_text("1")
    page.click("#stop")
    expect(turn).to_have_attribute("data-state", "stopped")
    # 60 s, under the script's ~100 s left: an unaborted request cannot leave by finishing
    wait_for(lambda: not scripted_in_flight(chat_server), "the stopped request gone", timeout=60)
    assert scripted_in_flight(chat_server) == 0  # ~100 s of script left: aborted, not finished
    assert cancelled_count(chat_server) == before + 1
    expect(page.locator("#send")).to_be_enabled()
    expect(page.locator("#stop")).to_be_disabled()


def answer_with(status: int, envelope: dict, retry_after: str):
    return lambda route: route.fulfill(
        status=status, json=envelope, headers={"Retry-After": retry_after}
    )


def test_errors_show_the_api_envelope(page, chat_server):
    from playwright.sync_api import expect

    page.guard.http_errors_expected = True  # the browser logs the 400 it is shown
    open_console(page, chat_server.url, "#playground")
    page.fill("#k-top-p", "5")
    page.fill("#prompt", "hello")
    page.click("#send")
    error = page.locator("#chat-error")
    expect(error).to_contain_text("HTTP 400 · BadRequestError")
    expect(error).to_contain_text("param: top_p")
    expect(page.locator(".msg.assistant")).to_have_count(0)
    page.fill("#k-top-p", "")
    # the server's 429/503 are tested in test_server_lifecycle; here, how the page shows them
    answers = [(429, "RateLimitError", "1"), (503, "ServiceUnavailableError", "5")]
    for status, kind, retry in answers:
        envelope = {"error": {"message": "busy", "type": kind, "param": None, "code": status}}
        page.route("**/v1/chat/completions", answer_with(status, envelope, retry))
        page.fill("#prompt", "hello")
        page.click("#send")
        expect(error).to_have_text(f"HTTP {status} · {kind} · busy · Retry-After: {retry} s")
        page.unroute("**/v1/chat/completions")


def test_model_output_is_text_never_html(page, chat_server):
    from playwright.sync_api import expect

    open_console(page, chat_server.url, "#playground")
    page.fill("#prompt", "[[script:html]]")
    page.click("#send")
    content = page.locator(".msg.assistant .content").first
    expect(content).to_have_text("<b>bold</b><img src=x onerror=alert(1)>")
    expect(page.locator(".msg.assistant .content *")).to_have_count(0)  # no element made


def test_api_key_field_and_named_tool_choice(page, chat_server):
    from playwright.sync_api import expect

    # a keyed server's config.json says so (test_console_api); the page then asks for the key
    config = {"chat": True, "api_key_required": True, "version": "test"}
    page.route("**/console/config.json", lambda route: route.fulfill(json=config))
    open_console(page, chat_server.url, "#playground")
    expect(page.locator("#api-key-row")).to_be_visible()
    expect(page.locator("#status-strip")).to_contain_text("API key needed")
    page.fill("#k-api-key", "sk-console")
    page.click("#k-tools-sample")
    page.select_option("#k-tool-choice", "function:get_weather")
    page.fill("#prompt", "[[script:weather]]")
    with page.expect_request("**/v1/chat/completions") as sent:
        page.click("#send")
    assert sent.value.headers["authorization"] == "Bearer sk-console"
    assert request_body(sent.value)["tool_choice"] == {
        "type": "function", "function": {"name": "get_weather"}
    }  # fmt: skip
    expect(page.locator("#status-strip [data-key=model]")).to_contain_text("glm-console")
    expect(page.locator(".msg.assistant").first).to_have_attribute("data-state", "tool_calls")
    assert "$DSASERVE_API_KEY" in page.locator("#request-curl").text_content()
    assert "sk-console" not in page.locator("#request-python").text_content()


def test_copy_as_curl_and_openai_python_run_against_the_server(page, chat_server):
    from playwright.sync_api import expect

    open_console(page, chat_server.url, "#playground")
    page.fill("#k-temperature", "0.5")
    page.fill("#k-top-k", "5")
    page.fill("#k-min-p", "0.1")
    page.fill("#k-seed", "7")
    page.fill("#prompt", "weather please [[script:sunny]]")
    page.click("#raw-request summary")
    python = page.locator("#request-python").text_content()
    assert '"top_k": 5' in python and "extra_body=" in python and "temperature=0.5" in python
    page.click("#copy-python")
    expect(page.locator("#copy-python")).to_have_text("Copied")
    assert page.evaluate("navigator.clipboard.readText()") == python
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    ran = subprocess.run([sys.executable, "-c", python], capture_output=True, text=True,
                         timeout=120, env=env)  # fmt: skip
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.strip() == ANSWER
    curl = page.locator("#request-curl").text_content()
    if shutil.which("curl") is None:  # a skip, which fails CI (tests/skip_policy.py)
        pytest.skip("curl is not installed: the copied curl command was not run (apt-get install "
                    "curl)")  # fmt: skip
    ran = subprocess.run(["bash", "-c", curl], capture_output=True, text=True, timeout=120)
    assert ran.returncode == 0, ran.stderr
    events = [json.loads(line[6:]) for line in ran.stdout.splitlines()
              if line.startswith("data: {")]  # fmt: skip
    content = "".join(c["choices"][0]["delta"].get("content") or "" for c in events if c["choices"])
    assert content == ANSWER
