"""Anthropic Messages API request models (pydantic), lenient on unknown fields."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore")


class Block(_Model):
    """Any content block; which fields matter depends on `type` (checked when translating)."""

    type: str
    text: str | None = None
    id: str | None = None
    name: str | None = None
    input: Any = None
    tool_use_id: str | None = None
    content: str | list[Block] | None = None
    is_error: bool | None = None
    thinking: str | None = None
    signature: str | None = None


class Message(_Model):
    role: Literal["user", "assistant", "system"]
    content: str | list[Block]


class AnthropicTool(_Model):
    name: str = Field(min_length=1)
    type: str | None = None
    description: str | None = None
    input_schema: dict[str, Any] | None = None


class MessagesRequest(_Model):
    model: str | None = None
    messages: list[Message] = Field(min_length=1)
    max_tokens: int = Field(gt=0)
    system: str | list[Block] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None


class CountTokensRequest(MessagesRequest):
    max_tokens: int = Field(default=1, gt=0)
