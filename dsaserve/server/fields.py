"""Field types shared by every route's request model: bounded integers, token ids, text, stop lists.

Every known field of every route is declared with one of these, so a value the engine or the IPC
boundary cannot carry (an integer over 64 bits, a token id outside the vocabulary, a list of a
million stop strings) is a 400 naming the field, before anything reaches the engine. Unknown
top-level fields are ignored (the models say `extra="ignore"`), as OpenAI and SGLang servers do,
so routers that re-serialise bodies with fields of their own keep working.

Integers are plain JSON numbers (`2` or `2.0`, never `true`, `"2"` or `2.5`), booleans are JSON
booleans. Nesting depth (anywhere) and lone surrogates (in known fields) are checked on the raw
JSON before validation (`json_limits`), naming the path.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    ValidationInfo,
)

INT64_MAX = 2**63 - 1
INT32_MAX = 2**31 - 1
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
MAX_PROMPT_IDS = 1 << 22  # prompt token ids per sequence (the context check comes later)
MAX_MESSAGES = 100_000
MAX_LIST_PROMPTS = 4096
MAX_TOOLS = 1024
MAX_NAME_CHARS = 256
MAX_RID_CHARS = 256
MAX_GRAMMAR_CHARS = 1 << 20  # a regex, EBNF grammar or JSON schema given as text


class Strict(BaseModel):
    """Base of every request model: unknown fields ignored, no NaN or infinity in any float."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


def max_items(limit: int) -> BeforeValidator:
    """Refuse a list over `limit` items before its items are validated (pydantic checks
    `max_length` only after validating every item, which is the slow part for a huge list)."""

    def check(value: Any) -> Any:
        if isinstance(value, list) and len(value) > limit:
            raise ValueError(f"at most {limit} items, got {len(value)}")
        return value

    return BeforeValidator(check)


def bounded_list(item: Any, limit: int, min_length: int = 0) -> Any:
    """`list[item]` of at most `limit` items, refused early, and described in the JSON schema
    (the Field comes first: constraints after a validator leave the schema's keywords)."""
    return Annotated[list[item], Field(min_length=min_length, max_length=limit), max_items(limit)]


def _plain_int(value: Any) -> Any:
    """JSON Schema's integer: `2` or `2.0`; pydantic's lax mode would also take `true`, `"2"`."""
    if isinstance(value, bool | str | bytes):
        raise ValueError("Input should be a valid integer")
    return value


def _plain_number(value: Any) -> Any:
    if isinstance(value, bool | str | bytes):
        raise ValueError("Input should be a valid number")
    return value


_PLAIN_INT = BeforeValidator(_plain_int)
_PLAIN_NUMBER = BeforeValidator(_plain_number)


def _in_vocab(value: int, info: ValidationInfo) -> int:
    vocab = (info.context or {}).get("vocab_size")
    if vocab is not None and value >= vocab:
        raise ValueError(f"token id {value} is not in this model's vocabulary [0, {vocab})")
    return value


Int32 = Annotated[int, Field(ge=-INT32_MAX - 1, le=INT32_MAX), _PLAIN_INT]
Count = Annotated[int, Field(ge=0, le=INT32_MAX), _PLAIN_INT]
Int64 = Annotated[int, Field(ge=-INT64_MAX - 1, le=INT64_MAX), _PLAIN_INT]
TokenId = Annotated[int, Field(ge=0, le=INT32_MAX), _PLAIN_INT, AfterValidator(_in_vocab)]
TokenIds = bounded_list(TokenId, MAX_PROMPT_IDS)
StopTokenIds = bounded_list(TokenId, MAX_STOP_TOKEN_IDS)
Name = Annotated[str, Field(max_length=MAX_NAME_CHARS)]
Rid = Annotated[str, Field(min_length=1, max_length=MAX_RID_CHARS)]
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]
Stop = StopString | bounded_list(StopString, MAX_STOP_STRINGS)
GrammarText = Annotated[str, Field(min_length=1, max_length=MAX_GRAMMAR_CHARS)]
Schema = GrammarText | dict[str, Any]  # a JSON schema, as text or as an object
Temperature = Annotated[float, Field(ge=0, le=100), _PLAIN_NUMBER]
TopP = Annotated[float, Field(gt=0, le=1), _PLAIN_NUMBER]
Unit = Annotated[float, Field(ge=0, le=1), _PLAIN_NUMBER]
Penalty = Annotated[float, Field(ge=-2, le=2), _PLAIN_NUMBER]
RepetitionPenalty = Annotated[float, Field(gt=0, le=100), _PLAIN_NUMBER]
AnthropicTemperature = Annotated[float, Field(ge=0, le=2), _PLAIN_NUMBER]
TopLogprobs = Annotated[int, Field(ge=0, le=20), _PLAIN_INT]
Positive = Annotated[int, Field(gt=0, le=INT32_MAX), _PLAIN_INT]
RoomId = Annotated[int, Field(ge=0, le=INT64_MAX), _PLAIN_INT]  # sglang-router: < 2^63
PortNumber = Annotated[int, Field(ge=0, le=65535), _PLAIN_INT]
Bool = StrictBool


def _top_k_rule(value: int) -> int:
    if value == 0:
        raise ValueError("top_k must be -1 (off) or at least 1")
    return value


def _within_max_n(value: int, info: ValidationInfo) -> int:
    limit = (info.context or {}).get("max_n")
    if limit is not None and value > limit:
        raise ValueError(f"n must be <= {limit} (--max-n), got {value}")
    return value


N = Annotated[int, Field(ge=1, le=INT32_MAX), _PLAIN_INT, AfterValidator(_within_max_n)]
TopK = Annotated[
    int,
    Field(ge=-1, le=INT32_MAX, json_schema_extra={"not": {"const": 0}}),
    _PLAIN_INT,
    AfterValidator(_top_k_rule),
]
