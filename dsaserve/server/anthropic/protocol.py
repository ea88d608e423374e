"""Anthropic Messages API request models (pydantic): unknown top-level fields ignored, every known
field typed; a content block of a type the API does not define is a 400 naming it."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from dsaserve.server.fields import (
    MAX_MESSAGES,
    MAX_STOP_STRINGS,
    MAX_TOOLS,
    AnthropicTemperature,
    Bool,
    Count,
    Name,
    Positive,
    StopString,
    Strict,
    TopK,
    TopP,
    bounded_list,
)

# The block types of the Messages API (client blocks, and server-tool results echoed back).
BlockType = Literal[
    "text", "image", "document", "search_result", "thinking", "redacted_thinking", "tool_use",
    "tool_result", "server_tool_use", "web_search_tool_result", "web_fetch_tool_result",
    "code_execution_tool_result", "bash_code_execution_tool_result",
    "text_editor_code_execution_tool_result", "tool_search_tool_result", "mcp_tool_use",
    "mcp_tool_result", "container_upload",
]  # fmt: skip


class Block(Strict):
    """Any content block; which fields matter depends on `type` (checked when translating)."""

    type: BlockType
    text: str | None = None
    id: Name | None = None
    name: Name | None = None
    input: Any = None
    tool_use_id: Name | None = None
    content: str | bounded_list(Block, MAX_MESSAGES) | None = None
    is_error: Bool | None = None
    thinking: str | None = None
    signature: str | None = None


class TextBlock(Strict):
    """A `system` block: the API allows text blocks only."""

    type: Literal["text"]
    text: str


Blocks = bounded_list(Block, MAX_MESSAGES)


class Message(Strict):
    role: Literal["user", "assistant", "system"]
    content: str | Blocks


class AnthropicTool(Strict):
    name: str = Field(min_length=1, max_length=256)
    type: Name | None = None
    description: str | None = None
    input_schema: dict[str, Any] | None = None


class ThinkingConfig(Strict):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: Count | None = None


class ToolChoice(Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: Name | None = None
    disable_parallel_tool_use: Bool | None = None


class OutputConfig(Strict):
    effort: Name | None = None


class MessagesRequest(Strict):
    model: str | None = None
    messages: bounded_list(Message, MAX_MESSAGES, min_length=1)
    max_tokens: Positive
    system: str | bounded_list(TextBlock, MAX_MESSAGES) | None = None
    stop_sequences: bounded_list(StopString, MAX_STOP_STRINGS) | None = None
    stream: Bool = False
    temperature: AnthropicTemperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    tools: bounded_list(AnthropicTool, MAX_TOOLS) | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    metadata: dict[str, Any] | None = None
    output_config: OutputConfig | None = None


class CountTokensRequest(MessagesRequest):
    max_tokens: Positive = 1
