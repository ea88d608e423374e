"""Files that ship inside the package: the embedded default model."""

from __future__ import annotations

from pathlib import Path


def default_model_path() -> Path:
    """The embedded GLM-5.3-architecture checkpoint used when no --model-path is given."""
    return Path(__file__).parent / "default_model"
