"""Files that ship inside the package: the embedded default model and its DFlash2 drafter."""

from __future__ import annotations

from pathlib import Path


def default_model_path() -> Path:
    """The embedded GLM-5.3-architecture checkpoint used when no --model-path is given."""
    return Path(__file__).parent / "default_model"


def default_drafter_path() -> Path:
    """The embedded model's DFlash2 drafter (block size 8), used by `--speculative-algorithm
    DFLASH` when no --speculative-draft-model-path is given."""
    return Path(__file__).parent / "default_dflash"
