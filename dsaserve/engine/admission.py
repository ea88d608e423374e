"""A request's checks before it is queued: the prompt against the vocabulary, the context and
the requests in flight; the sampling fields the sampler would index or hash with. Each failure
is a ValueError that names the field (the API answers it with a 400)."""

from __future__ import annotations

from dsaserve.engine.io import GenerateRequest
from dsaserve.sampling_params import SamplingParams


def check_request(request: GenerateRequest, in_flight: dict, vocab: int, context: int) -> None:
    if request.rid in in_flight:
        raise ValueError(f"rid {request.rid!r} is already in flight")
    if not request.input_ids:
        raise ValueError("input_ids must not be empty")
    if any(not 0 <= t < vocab for t in request.input_ids):
        raise ValueError(f"input_ids must be token ids in [0, {vocab})")
    if len(request.input_ids) >= context:
        raise ValueError(
            f"the prompt has {len(request.input_ids)} tokens; the context length is {context}"
        )


def sampling_params(fields: dict, defaults: dict) -> SamplingParams:
    """The request's SamplingParams; a field of the wrong name or type is a ValueError."""
    try:
        params = SamplingParams(**fields)
    except TypeError as e:
        raise ValueError(f"sampling: {e}") from e
    return params.with_defaults(defaults)


def check_params(params: SamplingParams, vocab: int, grammars_on: bool) -> None:
    """Token ids and seeds the sampler would index or hash with (the API checks them too)."""
    if any(not 0 <= t < vocab for t in params.stop_token_ids):
        raise ValueError(f"stop_token_ids must be token ids in [0, {vocab})")
    trigger = params.grammar_after_token_id
    if trigger is not None and not 0 <= trigger < vocab:
        raise ValueError(f"grammar_after_token_id must be a token id in [0, {vocab})")
    if params.grammar is not None and not grammars_on:
        raise ValueError(f"{params.grammar[0]}: structured output is off (--grammar-backend none)")
    if params.seed is not None and not -(2**63) <= params.seed < 2**63:
        raise ValueError("seed must be a 64-bit integer")
