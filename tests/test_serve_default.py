"""The README's first command: `dsaserve serve` with no --model-path serves the embedded model."""

from __future__ import annotations

import httpx
from server_harness import running_server

from dsaserve.assets import default_model_path


def test_dsaserve_serve_without_a_model_path_serves_the_embedded_model():
    with running_server(None) as server:
        models = httpx.get(f"{server.url}/v1/models", timeout=30).json()
        assert models["data"][0]["id"] == default_model_path().name
        reply = httpx.post(
            f"{server.url}/v1/chat/completions", timeout=120,
            json={"model": "x", "max_tokens": 8,
                  "messages": [{"role": "user", "content": "What is 15% of 240?"}]},
        )  # fmt: skip
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] > 0
