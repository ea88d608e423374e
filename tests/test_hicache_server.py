"""HiCache behind a real server: Claude-Code-shaped requests share their prefix through the
hierarchy, stats and metrics report each tier, /flush_cache says what it keeps, and a restarted
server serves a prefix from the storage tier."""

from __future__ import annotations

import json
from pathlib import Path

import anthropic
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_harness import running_server

from dsaserve.server.anthropic.protocol import MessagesRequest
from dsaserve.server.anthropic.translate import to_chat_request

TOOLS = [{"name": f"tool_{i}", "description": f"Tool number {i}: does thing {i} to a file.",
          "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}}}
         for i in range(6)]  # fmt: skip
SYSTEM_TEXT = "You are an interactive CLI tool that helps users with software engineering. " * 12


def billing(cch: str) -> str:
    return f"x-anthropic-billing-header: cc_version=2.1.37.a1b; cc_entrypoint=cli; cch={cch};"


def claude_code_request(cch: str, turns: list[dict]) -> dict:
    """What Claude Code >= 2.1.36 sends: the attribution block first, then the fixed system text."""
    cache = {"cache_control": {"type": "ephemeral"}}
    system = [
        {"type": "text", "text": billing(cch)},
        {"type": "text", "text": SYSTEM_TEXT, **cache},
    ]
    return {"model": "m", "max_tokens": 8, "system": system, "tools": TOOLS, "messages": turns}


def samples(text: str) -> dict[tuple[str, str], float]:
    """/metrics' HiCache gauges: (name, tier or direction) -> value (one model served)."""
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = sample.labels
            if sample.name.startswith("sglang:hicache"):
                key = sample.name, labels.get("tier") or labels.get("direction")
                assert key not in out, f"{key} twice: {text}"
                out[key] = sample.value
    return out


def hicache_flags(store: Path) -> list[str]:
    extra = json.dumps({"file_path": str(store), "prefetch_threshold": 16})
    return ["--enable-hierarchical-cache", "--hicache-storage-backend", "file",
            "--hicache-storage-backend-extra-config", extra, "--hicache-storage-prefetch-policy",
            "wait_complete", "--enable-cache-report", "--enable-metrics",
            "--max-total-tokens", "1024", "--context-length", "1000"]  # fmt: skip


@pytest.mark.parametrize("keep", [False, True])
def test_billing_line_dropped_unless_kept(keep):
    blocks = [{"type": "text", "text": billing("2")}, {"type": "text", "text": "You are helpful."}]
    for system in [billing("1") + "\nYou are helpful.", blocks]:
        body = to_chat_request(MessagesRequest.model_validate(
            {"model": "m", "max_tokens": 1, "system": system, "messages": [
                {"role": "user", "content": "hi"}]}), keep)  # fmt: skip
        text = body["messages"][0]["content"]
        assert text.endswith("You are helpful.") and ("billing-header" in text) == keep


def test_claude_code_prefix_restart_and_reporting(server_checkpoint: Path, tmp_path: Path):
    store = tmp_path / "store"
    first_turn = [{"role": "user", "content": "List the files in this folder."}]
    probe = list(range(100, 300))  # a /generate prompt of 200 tokens (12 whole pages of 16)
    with running_server(server_checkpoint, *hicache_flags(store)) as server:
        client = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0)
        one = client.messages.create(**claude_code_request("11111", first_turn))
        reply = "".join(b.text for b in one.content if b.type == "text") or "ok"
        turns = first_turn + [{"role": "assistant", "content": reply},
                              {"role": "user", "content": "Now read the README."}]  # fmt: skip
        two = client.messages.create(**claude_code_request("22222", turns))
        assert two.usage.cache_read_input_tokens > 0.5 * two.usage.input_tokens
        body = {"input_ids": probe, "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
        before = httpx.post(server.url + "/generate", json=body, timeout=60).json()
        flushed = httpx.post(server.url + "/flush_cache").json()
        assert flushed == {"success": True, "message": "flushed the device and host KV tiers "
                           "(the storage tier is kept)"}  # fmt: skip
        info = httpx.get(server.url + "/get_server_info").json()["internal_states"][0]
        assert info["hicache_host_used_tokens"] == 0 and info["hicache_storage_pages"] > 0
        assert info["hicache_d2h_bytes"] > 0 and info["hicache_storage_write_bytes"] > 0
        after_flush = httpx.post(server.url + "/generate", json=body, timeout=60).json()
        assert after_flush["output_ids"] == before["output_ids"]
        assert after_flush["meta_info"]["cached_tokens"] == 192  # from storage after the flush
        info = httpx.get(server.url + "/get_server_info").json()["internal_states"][0]
        metrics = samples(httpx.get(server.url + "/metrics").text)
        assert metrics["sglang:hicache_hit_tokens", "storage"] == 192  # the after-flush prefix
        assert metrics["sglang:hicache_hit_tokens", "storage"] == info["hicache_storage_hit_tokens"]
        assert (
            metrics["sglang:hicache_transfer_bytes", "storage_to_device"]
            == (info["hicache_storage_load_bytes"])
            > 0
        )
        assert metrics["sglang:hicache_transfer_bytes", "device_to_host"] > 0
        assert metrics["sglang:hicache_load_seconds", "storage"] > 0
        text = httpx.get(server.url + "/metrics").text
        cached = {s.labels["cache_source"]: s.value for family in
                  text_string_to_metric_families(text) for s in family.samples
                  if s.name == "sglang:cached_tokens_total"}  # fmt: skip
        assert cached["storage_file"] >= 192  # SGLang's label: storage_<backend>
        assert cached["device"] > 0 and "host" in cached
    with running_server(server_checkpoint, *hicache_flags(store)) as restarted:
        again = httpx.post(restarted.url + "/generate", json=body, timeout=60).json()
        assert again["output_ids"] == before["output_ids"]
        assert again["meta_info"]["cached_tokens"] == 192
        info = httpx.get(restarted.url + "/get_server_info").json()["internal_states"][0]
        assert (
            info["hicache_storage_hit_tokens"] == 192
            and info["hicache_storage_rejected_pages"] == 0
        )
