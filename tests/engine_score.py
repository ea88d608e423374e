"""The logits of every position of one sequence, from a built `Engine` (for checks that compare
weight formats or KV dtypes logit by logit): one prefill through the engine's own runner, no
caching, its pages freed after."""

from __future__ import annotations

import torch

from dsaserve.engine.detokenizer import IncrementalDetokenizer
from dsaserve.engine.engine import Engine
from dsaserve.engine.request import Req
from dsaserve.engine.sampler import SamplingState
from dsaserve.engine.scheduler import ScheduledBatch
from dsaserve.sampling_params import SamplingParams


def score(engine: Engine, input_ids: list[int]) -> torch.Tensor:
    """Logits [len, V] of every position of `input_ids`."""
    params = SamplingParams(max_tokens=1).with_defaults({})
    state = SamplingState(params, input_ids, engine.model_config.vocab_size, [])
    detok = IncrementalDetokenizer(engine.tokenizer, input_ids, [], True, False)
    req = Req("score", list(input_ids), params, state, detok)
    if not engine.scheduler.grow(req, len(input_ids)):
        raise RuntimeError("not enough free KV to score this sequence")
    try:
        scheduled = ScheduledBatch([req], [0], [len(input_ids)])
        return engine.runner.forward(scheduled, all_rows=True)[1]
    finally:
        engine.pool.pages.free(req.pages)
