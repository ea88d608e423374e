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

from dsaserve.engine.forward_batch import ForwardBatch
from dsaserve.layers.fused import FusedDecode

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
    def build(cls, model: nn.Module, enabled: bool, compiled: bool,
              native: bool = True) -> DecodeStep | None:  # fmt: skip
        """The decode step of `model`, or None (layered model for every step) when disabled or
        when the weights are not plain same-dtype linears (e.g. FP8). `native`: run the layers
        in the C++ extension (kernels/cpu_decode.py) where it builds; compiling takes the
        Python path (torch.compile traces Python)."""
        fused = FusedDecode.build(model, native=native and not compiled) if enabled else None
        if fused is None:
            if compiled:
                logger.warning("--enable-torch-compile: no fused decode path for this model")
            return None
        return cls(fused, compiled)

    @staticmethod
    def accepts(batch: ForwardBatch) -> bool:
        return FusedDecode.accepts(batch)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.fused.logits(hidden)

    def tapped(self, taps: tuple[int, ...]) -> torch.Tensor:
        """The installed all-decode batch's [final ‖ tapped layers] (a DFlash verify; the
        uncompiled fused path)."""
        return self.fused.forward(taps)

    def __call__(self, batch: ForwardBatch) -> torch.Tensor:
        if not self._first_call:
            return self._forward()
        start = time.perf_counter()
        out = self._forward()
        self._first_call = False
        logger.info("compiled the decode step in %.1f s", time.perf_counter() - start)
        return out
