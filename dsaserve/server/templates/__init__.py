"""Prompt formats written in Python, for checkpoints that ship no Jinja chat template."""

from __future__ import annotations

import json
from pathlib import Path


def model_type_of(model_path: str) -> str | None:
    """The checkpoint's `config.json` `model_type` (None when it cannot be read)."""
    try:
        config = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return config.get("model_type") if isinstance(config, dict) else None
