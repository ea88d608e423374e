"""What the routes share: the flags, the tokenizer manager, the engine client, the metrics,
the stored responses."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dsaserve.args import ServerArgs


@dataclass
class ServerState:
    """Mutable server status (ready, draining) plus the long-lived helpers."""

    args: ServerArgs
    tokenizer_manager: Any = None
    engine: Any = None
    metrics: Any = None
    body_decoder: Any = None
    response_store: Any = None  # /v1/responses `store: true` (openai/responses_store.py)
    ready: bool = False
    draining: bool = False
    engine_info: dict = field(default_factory=dict)
    in_flight: int = 0
