"""The web console's Deploy panel in headless Chromium, against `dsaserve plan --web` (the
browser, the page guard and the screenshots are test_console_browser.py's)."""

from __future__ import annotations

import re
from collections.abc import Iterator

import httpx
import pytest
import test_console_browser
from test_console_api import running_plan_web
from test_console_browser import open_console, screenshot

# test_console_browser.py's fixtures: one Chromium for the module, a guarded page, screenshots
browser, page = test_console_browser.browser, test_console_browser.page
shots = test_console_browser.shots


@pytest.fixture(scope="module")
def planner() -> Iterator[str]:
    with running_plan_web() as url:
        yield url


def test_deploy_balanced_h200_shows_the_command_and_the_fit(page, planner, shots):
    from playwright.sync_api import expect

    open_console(page, planner)
    page.select_option("#f-base", "GLM-5.3")
    page.select_option("#f-precision", "fp8")
    page.select_option("#f-hardware", "H200")
    page.click("#f-recipe label:has-text('Balanced')")
    expect(page.locator("#plan-headline")).to_contain_text("on 1 × 8 × H200, balanced")
    command = page.locator(".command[data-role=serve] pre")
    expect(command).to_contain_text("--tp 8 --dp 8 --ep 8 --enable-dp-attention")
    expected = httpx.post(planner + "/api/plan", json={"recipe": "balanced"}).json()
    assert command.inner_text() == expected["commands"][0]["dsaserve"]
    memory = expected["memory"]
    fit = page.locator("#plan-memory")
    expect(fit).to_contain_text("weights per GPU")
    expect(fit.locator("tr:has-text('concurrency') td")).to_have_text(
        f"{memory['concurrency']} requests of {memory['tokens_per_request']:,} tokens"
    )
    expect(fit.locator("tr:has-text('KV per token') td")).to_contain_text("100,152 B (bf16)")
    rule = page.locator("#plan-rules li:has-text('recipe-balanced')")
    expect(rule).to_contain_text("DP attention + expert parallel (DeepEP)")  # its statement
    screenshot(page, shots / "console-deploy.png")
    page.click(".command[data-role=serve] button.copy")
    clipboard = page.evaluate("navigator.clipboard.readText()")
    assert clipboard == expected["commands"][0]["dsaserve"]
    page.click("label:has-text('SGLang')")
    expect(command).to_have_text(expected["commands"][0]["sglang"])


def test_bf16_on_one_h200_node_is_refused_and_the_nearest_layout_is_one_click(page, planner):
    from playwright.sync_api import expect

    open_console(page, planner, "#deploy?model=GLM-5.3&hardware=H200&recipe=low-latency")
    page.select_option("#f-nodes", "1")
    page.select_option("#f-precision", "bf16")
    refusal = page.locator("#plan-refusal")
    expect(refusal).to_be_visible()
    expect(refusal.locator(".rule-name")).to_have_text("weights-fit")
    expect(refusal).to_contain_text("BF16 weights need")
    expect(refusal).to_contain_text("--nodes 2")
    expect(page.locator(".command")).to_have_count(0)
    # the matrix greys the refused choice out and says why
    option = page.locator("#f-precision option[value=bf16]")
    expect(option).to_have_class(re.compile("refused"))
    assert "weights-fit" in option.get_attribute("title")
    page.click("#use-nearest")
    expect(page.locator("#plan-headline")).to_contain_text("GLM-5.3-BF16 (BF16) on 2 × 8 × H200")
    expect(refusal).to_be_hidden()
    assert page.input_value("#f-nodes") == "2"
    commands = page.locator(".command[data-role=serve] pre")
    expect(commands).to_have_count(2)
    for rank in (0, 1):
        text = commands.nth(rank).inner_text()
        assert "--tp 16" in text and f"--nnodes 2 --node-rank {rank}" in text


def test_a_shared_url_restores_the_layout(page, planner, browser):
    from playwright.sync_api import expect

    open_console(page, planner)
    page.select_option("#f-hardware", "B200")
    page.click("#f-recipe label:has-text('High-Throughput')")
    page.select_option("select[name=pd]", "decode")
    page.select_option("select[name=pd_transfer_backend]", "nixl")
    page.check("input[name=hicache]")
    page.select_option("select[name=hicache_write_policy]", "write_back")
    page.fill("input[name=input_len]", "4096")
    command = page.locator(".command[data-role=decode] pre")
    expect(command).to_contain_text("--hicache-write-policy write_back")
    expect(command).to_contain_text("--disaggregation-transfer-backend nixl")
    shared, text = page.url, command.inner_text()
    assert "hardware=B200" in shared and "hicache=true" in shared
    other = browser.new_context().new_page()
    try:
        open_console(other, shared.split("/console/")[0], "#" + shared.split("#", 1)[1])
        expect(other.locator(".command[data-role=decode] pre")).to_have_text(text)
        assert other.input_value("#f-hardware") == "B200"
        assert other.input_value("select[name=hicache_write_policy]") == "write_back"
        assert other.input_value("input[name=input_len]") == "4096"
        assert other.is_checked("#f-recipe input[value=high-throughput]")
        expect(other.locator(".command[data-role=router]")).to_have_count(1)
    finally:
        other.context.close()


def test_planner_only_console_has_no_chat(page, planner):
    from playwright.sync_api import expect

    open_console(page, planner, "#playground")
    expect(page.locator("#no-chat")).to_be_visible()
    expect(page.locator("#send")).to_be_disabled()
    expect(page.locator("#status-strip")).to_contain_text("planner only")
