"""Per-request sampling parameters (the offline API's and the engine's one shape)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

# What each field may hold (the engine gets these as a plain dict over IPC and trusts no caller).
_INTS = ("max_tokens", "min_tokens", "top_k", "seed", "logprobs", "n", "grammar_after_token_id")
_FLOATS = ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty",
           "presence_penalty")  # fmt: skip
_BOOLS = ("ignore_eos", "skip_special_tokens", "no_stop_trim")
GRAMMAR_FIELDS = ("json_schema", "regex", "ebnf", "tool_call_grammar")  # text, or None
_OPTIONAL = ("max_tokens", "temperature", "top_p", "top_k", "seed", "logprobs",
             "grammar_after_token_id", *GRAMMAR_FIELDS)  # fmt: skip
_INT_LISTS = ("stop_token_ids",)
_STR_LISTS = ("stop", "grammar_think_exits")


@dataclass
class SamplingParams:
    """How to sample one completion. `None` means "the checkpoint's generation_config default".

    `logprobs`: None for no log-probabilities, else the number of top alternatives per token
    (0 returns only the chosen token's). `n` > 1 is expanded by the front ends into n requests
    (choice i uses seed + i when a seed is given).

    Structured output (SGLang's names; at most one of them): `json_schema` (JSON text), `regex`,
    `ebnf`, or `tool_call_grammar` (JSON text: the tools and tool_choice the server turns into a
    grammar of the model's own tool-call format, see `dsaserve.grammar.tool_calls`). The grammar
    constrains the output from the first token, or, when `grammar_after_token_id` is set (the
    server sets `</think>` when the prompt opens reasoning), from the token after that one;
    until then the end tokens are masked, and so is every other way the reasoning parser would
    see thinking end (`grammar_think_exits`: its exit tags, as tokens or spelled in pieces; see
    `dsaserve.grammar.thinking`), so thinking ends at that token for the parser and the grammar.
    """

    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    n: int = 1
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    tool_call_grammar: str | None = None
    grammar_after_token_id: int | None = None
    grammar_think_exits: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the field for values no sampler can honour."""
        self._check_types()
        checks = [
            (self.max_tokens is None or self.max_tokens >= 0, "max_tokens", "must be >= 0"),
            (self.min_tokens >= 0, "min_tokens", "must be >= 0"),
            (self.temperature is None or self.temperature >= 0, "temperature", "must be >= 0"),
            (self.top_p is None or 0 < self.top_p <= 1, "top_p", "must be in (0, 1]"),
            (self.top_k in (None, -1) or self.top_k >= 1, "top_k", "must be >= 1 or -1"),
            (0 <= self.min_p <= 1, "min_p", "must be in [0, 1]"),
            (self.repetition_penalty > 0, "repetition_penalty", "must be > 0"),
            (-2 <= self.frequency_penalty <= 2, "frequency_penalty", "must be in [-2, 2]"),
            (-2 <= self.presence_penalty <= 2, "presence_penalty", "must be in [-2, 2]"),
            (self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs", "must be in [0, 20]"),
            (self.n >= 1, "n", "must be >= 1"),
        ]
        for ok, name, rule in checks:
            if not ok:
                raise ValueError(f"{name} {rule}, got {getattr(self, name)!r}")
        grammars = [name for name in GRAMMAR_FIELDS if getattr(self, name) is not None]
        if len(grammars) > 1:
            raise ValueError(f"{grammars[1]} cannot be combined with {grammars[0]}: give one")

    def _check_types(self) -> None:
        for name in (*_INTS, *_FLOATS, *_BOOLS, *_STR_LISTS, *_INT_LISTS, *GRAMMAR_FIELDS):
            value = getattr(self, name)
            if value is None and name in _OPTIONAL:
                continue
            if not _type_ok(name, value):
                raise ValueError(f"{name} has the wrong type ({type(value).__name__})")

    def with_defaults(self, defaults: dict) -> SamplingParams:
        """Fill the unset (None) fields from a generation_config-style dict."""
        filled = {k: defaults[k] for k in ("temperature", "top_p", "top_k") if k in defaults}
        changes = {k: v for k, v in filled.items() if getattr(self, k) is None}
        out = dataclasses.replace(self, **changes)
        out.temperature = 1.0 if out.temperature is None else out.temperature
        out.top_p = 1.0 if out.top_p is None else out.top_p
        out.top_k = -1 if out.top_k is None or out.top_k == 0 else out.top_k
        return out

    @property
    def grammar(self) -> tuple[str, str] | None:
        """(kind, source) of the structured-output grammar, or None."""
        for name in GRAMMAR_FIELDS:
            value = getattr(self, name)
            if value is not None:
                return name, value
        return None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _type_ok(name: str, value: Any) -> bool:
    if name in _INTS:
        return _is_int(value)
    if name in _FLOATS:
        return (_is_int(value) or isinstance(value, float)) and math.isfinite(value)
    if name in _BOOLS:
        return isinstance(value, bool)
    if name in _STR_LISTS:
        return isinstance(value, list | tuple) and all(isinstance(v, str) for v in value)
    if name in GRAMMAR_FIELDS:
        return isinstance(value, str)
    return isinstance(value, list | tuple) and all(_is_int(v) for v in value)
