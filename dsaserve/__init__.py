"""dsaserve: a small, exact serving engine for DSA Mixture-of-Experts models."""

from __future__ import annotations

from dsaserve.runtime.omp import limit_omp_spinning

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name: str):
    # Lazy: `dsaserve --version` and the API process must not import torch for nothing.
    if name == "LLM":
        limit_omp_spinning()  # before dsaserve.llm imports torch (runtime/omp.py)
        from dsaserve.llm import LLM

        return LLM
    if name == "SamplingParams":
        from dsaserve.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(name)
