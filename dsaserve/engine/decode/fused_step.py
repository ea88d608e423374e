"""The forward of all-decode batches: the fused decode path, optionally `torch.compile`d.

`ModelRunner` hands a batch here when every row is a decode row (no prefill chunk, no extend
run); everything else takes the layered model. `--disable-fused-decode` turns the fused path
off (every step then runs the layered model), `--enable-torch-compile` compiles it (SGLang's
flag name; off by default, see docs/benchmarks.md, "CPU decode vs llama.cpp").
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch
from torch import nn

from dsaserve.engine.decode.fused import FusedDecode
from dsaserve.layers.forward_batch import ForwardBatch

logger = logging.getLogger(__name__)


class DecodeStep:
    def __init__(self, fused: FusedDecode, compiled: bool = False) -> None:
        self.fused = fused
        self.compiled = compiled
        self._forward: Callable[[], torch.Tensor] = fused.forward
        if compiled:
            # dynamic=True: one graph for every batch size and context length (marked dynamic
            # from the first call), instead of a recompile per length as the context grows.
            self._forward = torch.compile(fused.forward, dynamic=True)
        self._first_call = compiled

    @classmethod
    def build(cls, model: nn.Module, enabled: bool, compiled: bool, native: bool = True,
              cache_dtype: torch.dtype = torch.float32,
              parallel=None) -> DecodeStep | None:  # fmt: skip
        """The decode step of `model`, or None (layered model for every step) when disabled or
        when the weights are not plain same-dtype linears (e.g. FP8). `native`: run the layers
        in the C++ extension (engine/decode/native.py) where it builds; compiling takes the
        Python path (torch.compile traces Python). `cache_dtype`: the pool's storage dtype
        (uint8: FP8); only the native layers read a pool in another dtype than fp32.
        `parallel` (several ranks): the native layers over this rank's shard, or None."""
        native = native and not compiled
        fused = FusedDecode.build(model, native, cache_dtype, parallel) if enabled else None
        if fused is None:
            if compiled:
                logger.warning("--enable-torch-compile: no fused decode path for this model")
            return None
        return cls(fused, compiled)

    @staticmethod
    def accepts(batch: ForwardBatch) -> bool:
        return FusedDecode.accepts(batch)

    @property
    def native(self):
        """The native layers (engine/decode/native.py), or None: the Python fused path."""
        return self.fused.native

    def __call__(self, batch: ForwardBatch) -> torch.Tensor:
        """The logits [T, V] of every row of `batch` (installed)."""
        if not self._first_call:
            return self._forward()
        start = time.perf_counter()
        out = self._forward()
        self._first_call = False
        logger.info("compiled the decode step in %.1f s", time.perf_counter() - start)
        return out
