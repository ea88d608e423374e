"""The engine's boundary: what goes in (a tokenised request) and what comes out each step.

These are the messages between the API process and the engine process (msgspec over ZMQ) and
what the offline `LLM` reads. One request here is one completion: front ends expand `n`.
"""

from __future__ import annotations

import msgspec


class Bootstrap(msgspec.Struct, kw_only=True):
    """Where a disaggregated request's KV comes from (prefill/decode roles): SGLang's
    `bootstrap_host`, `bootstrap_port` (the prefill's bootstrap server) and `bootstrap_room`."""

    host: str
    port: int
    room: int


class GenerateRequest(msgspec.Struct, kw_only=True):
    rid: str
    input_ids: list[int]
    # SamplingParams as a dict (dataclasses.asdict); the engine rebuilds and fills defaults.
    sampling: dict
    stream: bool = True
    bootstrap: Bootstrap | None = None  # set only on --disaggregation-mode prefill|decode


class TokenLogprob(msgspec.Struct, array_like=True):
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # top alternatives (token_id, logprob), best first


class RequestOutput(msgspec.Struct, kw_only=True):
    """New tokens of one request since its previous output.

    `text` is the newly confirmed text: held back while it could still become part of a stop
    string or an incomplete UTF-8 character, and trimmed of a matched stop string at the end.
    `finish_reason` is set once: {"type": "stop"|"length"|"abort", "matched": int|str|None}.
    """

    rid: str
    token_ids: list[int]
    text: str
    finished: bool = False
    finish_reason: dict | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    logprobs: list[TokenLogprob] | None = None
    spec_verify_ct: int = 0
    spec_accept_length: float | None = None  # completion_tokens / spec_verify_ct
    spec_accept_rate: float | None = None  # correct drafts / proposed drafts
    spec_num_correct_drafts: int = 0
    spec_num_proposed_drafts: int = 0
    error: str | None = None  # set (finished, abort) when the request could not be served: a 400
