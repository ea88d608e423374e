"""What the benchmark asks the server before and after a run: model name, model path, accept length.

Every probe is optional: a server without the route (OpenAI, `transformers serve`) yields None.
"""

from __future__ import annotations

from typing import Any

import httpx

PROBE_TIMEOUT_S = 10.0


async def get_json(client: httpx.AsyncClient, url: str, timeout: float) -> Any | None:
    """GET `url` and decode JSON; None on any failure (missing route, network, bad body)."""
    try:
        response = await client.get(url, timeout=timeout)
        if response.status_code != 200:
            return None
        return response.json()
    except (httpx.HTTPError, ValueError):
        return None


async def served_model(client: httpx.AsyncClient, base_url: str) -> str | None:
    """The first model id of `GET /v1/models`, or None."""
    body = await get_json(client, f"{base_url}/v1/models", PROBE_TIMEOUT_S)
    models = body.get("data") if isinstance(body, dict) else None
    if not models or not isinstance(models[0], dict):
        return None
    return models[0].get("id")


async def server_info(client: httpx.AsyncClient, base_url: str) -> dict[str, Any] | None:
    """`GET /get_server_info` (SGLang and dsaserve), or None."""
    body = await get_json(client, f"{base_url}/get_server_info", PROBE_TIMEOUT_S)
    return body if isinstance(body, dict) else None


def model_path(info: dict[str, Any] | None) -> str | None:
    """The tokenizer or model path the server reports, if any."""
    if not info:
        return None
    return info.get("tokenizer_path") or info.get("model_path")


def accept_length(info: dict[str, Any] | None) -> float | None:
    """Speculative accept length: `internal_states[0].avg_spec_accept_length`, else top level."""
    if not info:
        return None
    states = info.get("internal_states")
    if isinstance(states, list) and states and isinstance(states[0], dict):
        value = states[0].get("avg_spec_accept_length")
        if value is not None:
            return float(value)
    value = info.get("avg_spec_accept_length")
    return float(value) if value is not None else None


def server_threads(info: dict[str, Any] | None) -> str | None:
    """The server's CPU threads and decode path (`internal_states[0]`), e.g. "2 (native)"."""
    states = (info or {}).get("internal_states")
    if not isinstance(states, list) or not states or not isinstance(states[0], dict):
        return None
    threads, path = states[0].get("cpu_threads"), states[0].get("decode_path")
    if threads is None:
        return None
    return f"{threads} ({path})" if path else str(threads)
