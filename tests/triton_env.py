"""Run Triton kernels on CPU: the interpreter, switched on before `triton` is first imported
(conftest.py imports this module first: transformers may import triton, and the interpreter
must be chosen before that)."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

gpu = pytest.mark.gpu  # skipped without CUDA by tests/skip_policy.py (a hardware marker)

HAS_TRITON = importlib.util.find_spec("triton") is not None
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
