"""OpenAI-compatible request models (pydantic). Unknown fields are ignored; wrong types, bad
values and unknown roles fail validation and come back as 400 naming the field."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore")


class FunctionDef(_Model):
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Model):
    type: Literal["function"] = "function"
    function: FunctionDef


class ToolChoiceFunction(_Model):
    name: str


class NamedToolChoice(_Model):
    type: Literal["function"] = "function"
    function: ToolChoiceFunction


class FunctionCallIn(_Model):
    name: str
    arguments: str | dict[str, Any] | None = None


class ToolCallIn(_Model):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ContentPart(_Model):
    type: str
    text: str | None = None


class ChatMessage(_Model):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


class StreamOptions(_Model):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class JsonSchemaFormat(_Model):
    """`response_format.json_schema`: the schema is enforced by a grammar whatever `strict` says."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Model):
    type: Literal["text", "json_object", "json_schema"] = "text"
    json_schema: JsonSchemaFormat | None = None


class SamplingFields(_Model):
    """Fields shared by chat and completions."""

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=0)
    temperature: float | None = Field(default=None, ge=0, le=100)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = None
    min_p: float = Field(default=0.0, ge=0, le=1)
    frequency_penalty: float = Field(default=0.0, ge=-2, le=2)
    presence_penalty: float = Field(default=0.0, ge=-2, le=2)
    repetition_penalty: float = Field(default=1.0, gt=0)
    min_tokens: int = Field(default=0, ge=0)
    n: int = Field(default=1, ge=1, le=64)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    rid: str | None = None
    # SGLang's structured-output extras (dsaserve.server.structured)
    json_schema: str | dict[str, Any] | None = None
    regex: str | None = None
    ebnf: str | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=0)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[Tool] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    response_format: ResponseFormat | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    separate_reasoning: bool = True
    stream_reasoning: bool = True
    return_meta_info: bool = False


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=0)
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=20)
    suffix: str | None = None


class GenerateRequestIn(_Model):
    """SGLang's native `/generate` body."""

    text: str | None = None
    input_ids: list[int] | None = None
    sampling_params: dict[str, Any] = Field(default_factory=dict)
    stream: bool = False
    return_logprob: bool = False
    top_logprobs_num: int = Field(default=0, ge=0, le=20)
    rid: str | None = None


class AbortIn(_Model):
    """`/abort_request`: one request by rid, or all of them."""

    rid: str = ""
    abort_all: bool = False
