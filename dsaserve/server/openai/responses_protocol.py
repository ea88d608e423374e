"""OpenAI Responses API request models (pydantic) for `POST /v1/responses`.

Every known field is typed and bounded (see `fields.py`); unknown top-level fields are ignored
(Codex adds `client_metadata`, others `prompt_cache_retention`, ...). An input item or a tool is
one model whatever its `type`: which fields matter depends on the type, and the translation to a
chat request (`responses_items.py`) checks them, naming the field (`input[3].call_id`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Discriminator, Field, Tag, field_validator

from dsaserve.server.fields import (
    MAX_MESSAGES,
    MAX_TOOLS,
    Bool,
    Count,
    Name,
    Strict,
    Temperature,
    TopLogprobs,
    TopP,
    bounded_list,
)

MAX_PARTS = 4096  # content parts of one item
MAX_INCLUDE = 16
MAX_METADATA = 16  # OpenAI's limits: 16 pairs, keys up to 64 characters, values up to 512
MAX_METADATA_KEY, MAX_METADATA_VALUE = 64, 512
Effort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]


class Part(Strict):
    """A content part: `input_text`, `output_text`, `refusal`, `summary_text`, `reasoning_text`
    (text), or `input_image`, `input_file`, `input_audio` (not served: a text-only model)."""

    type: Name
    text: str | None = None
    refusal: str | None = None


def _text_or_list(value: Any) -> str:
    return "str" if isinstance(value, str) else "list"


def text_or(items: Any) -> Any:
    """A string or a list of `items`: only the branch the value's JSON type picks is checked, so
    an error names the bad item (`input[2].role`), not "input: should be a string" as well."""
    return Annotated[Annotated[str, Tag("str")] | Annotated[items, Tag("list")],
                     Discriminator(_text_or_list)]  # fmt: skip


Parts = bounded_list(Part, MAX_PARTS)


class InputItem(Strict):
    """One input item. `type` None is the short message form `{"role", "content"}`."""

    type: Name | None = None
    role: Literal["user", "assistant", "system", "developer"] | None = None
    content: text_or(Parts) | None = None  # a message's parts, or reasoning_text parts
    summary: Parts | None = None  # reasoning
    call_id: Name | None = None  # function_call, function_call_output
    name: Name | None = None  # function_call
    arguments: str | None = None  # function_call: JSON text
    output: text_or(Parts) | None = None  # function_call_output


class ResponsesTool(Strict):
    """A tool: `function` (flat: name, description, parameters, strict) is served; the other
    types (`web_search`, `namespace`, `file_search`, `custom`, `mcp`, ...) are left out."""

    type: Name
    name: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: Bool | None = None


class AllowedTool(Strict):
    type: Name
    name: Name | None = None


class ToolChoiceObject(Strict):
    """`{"type": "function", "name"}`, `{"type": "allowed_tools", "mode", "tools"}`, or a hosted
    tool type (refused: this server cannot run it)."""

    type: Name
    name: Name | None = None
    mode: Literal["auto", "required"] | None = None
    tools: bounded_list(AllowedTool, MAX_TOOLS) | None = None


class TextFormat(Strict):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: Name | None = None
    description: str | None = None
    schema_: dict[str, Any] | Bool | None = Field(default=None, alias="schema")
    strict: Bool | None = None


class TextConfig(Strict):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ReasoningConfig(Strict):
    effort: Effort | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None  # the old name


class ResponsesRequest(Strict):
    model: str | None = None
    input: text_or(bounded_list(InputItem, MAX_MESSAGES)) | None = None
    instructions: str | None = None
    previous_response_id: Name | None = None
    store: Bool = False  # stateless unless asked (OpenAI's default is true)
    stream: Bool = False
    background: Bool = False
    tools: bounded_list(ResponsesTool, MAX_TOOLS) | None = None
    tool_choice: Literal["auto", "none", "required"] | ToolChoiceObject | None = None
    parallel_tool_calls: Bool = True
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    max_output_tokens: Count | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_logprobs: TopLogprobs | None = None
    metadata: dict[str, str] | None = None
    prompt_cache_key: Name | None = None  # a hint: the radix cache finds shared prefixes anyway
    include: bounded_list(Name, MAX_INCLUDE) | None = None
    truncation: Literal["auto", "disabled"] | None = None
    max_tool_calls: Count | None = None
    user: Name | None = None
    safety_identifier: Name | None = None
    service_tier: Name | None = None
    conversation: Any = None  # refused: no Conversations API here
    prompt: Any = None  # refused: no stored prompt templates here
    chat_template_kwargs: dict[str, Any] | None = None  # as on the chat route

    @field_validator("metadata", mode="before")
    @classmethod
    def _bounded_metadata(cls, value: Any) -> Any:
        if not isinstance(value, dict):
            return value  # None, or the wrong type: pydantic names it
        if len(value) > MAX_METADATA:
            raise ValueError(f"at most {MAX_METADATA} pairs, got {len(value)}")
        for key, text in value.items():
            long_text = isinstance(text, str) and len(text) > MAX_METADATA_VALUE
            if len(key) > MAX_METADATA_KEY or long_text:
                raise ValueError(f"keys up to {MAX_METADATA_KEY} characters, values up to "
                                 f"{MAX_METADATA_VALUE}")  # fmt: skip
        return value

    def summary(self) -> str | None:
        """The reasoning summary asked for: the thinking then goes out as `summary` text (else
        as `reasoning_text` content)."""
        reasoning = self.reasoning
        return (reasoning.summary or reasoning.generate_summary) if reasoning else None
