"""A request's way in: its checks before it is queued (the prompt against the vocabulary, the
context and the requests in flight; the sampling fields the sampler would index or hash with),
each failure a ValueError that names the field (the API answers it with a 400), and the `Req`
it becomes (`Admission`: the tokenizer, the checkpoint's generation defaults and EOS ids, the
grammar gate)."""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer

from dsaserve.args import ServerArgs
from dsaserve.engine.detokenizer import IncrementalDetokenizer
from dsaserve.engine.grammar_gate import GrammarGate
from dsaserve.engine.messages import GenerateRequest
from dsaserve.engine.request import Req
from dsaserve.engine.sampler import SamplingState
from dsaserve.engine.startup import generation_defaults
from dsaserve.model_config import ModelConfig
from dsaserve.sampling_params import SamplingParams


class Admission:
    """Turns a checked `GenerateRequest` into a `Req` (not yet queued)."""

    def __init__(self, args: ServerArgs, config: ModelConfig, context_length: int) -> None:
        self.tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_path or args.model_path)
        self.generation_defaults = generation_defaults(Path(args.model_path))
        eos = list(self.generation_defaults.get("eos_token_id", []))
        self.eos_token_ids = eos or list(config.eos_token_ids)
        self.vocab, self.context_length = config.vocab_size, context_length
        self.grammar = GrammarGate(args.grammar_backend, self.tokenizer, self.vocab,
                                   self.eos_token_ids)  # fmt: skip

    def make_req(self, request: GenerateRequest, in_flight: dict) -> Req:
        """A checked `Req` for `request` (ValueError naming the field)."""
        check_request(request, in_flight, self.vocab, self.context_length)
        params = sampling_params(request.sampling, self.generation_defaults)
        check_params(params, self.vocab, self.grammar.compiler is not None)
        state = SamplingState(params, request.input_ids, self.vocab, self.eos_token_ids)
        detok = IncrementalDetokenizer(
            self.tokenizer, request.input_ids, params.stop, params.skip_special_tokens,
            params.no_stop_trim,
        )  # fmt: skip
        return Req(request.rid, list(request.input_ids), params, state, detok, request.stream)


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
