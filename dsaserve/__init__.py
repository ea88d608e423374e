"""dsaserve: a small, exact serving engine for DSA Mixture-of-Experts models."""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name: str):
    # Lazy: `dsaserve --version` and the API process must not import torch for nothing.
    if name == "LLM":
        from dsaserve.llm import LLM

        return LLM
    if name == "SamplingParams":
        from dsaserve.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(name)
