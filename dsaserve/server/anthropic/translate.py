"""Anthropic Messages request -> OpenAI chat request (one pipeline, two envelopes).

System text (string or blocks) leads; `tool_use` becomes `tool_calls`; `tool_result` becomes a
`tool` message (text before it in the same message is sent first, so order holds); `thinking`
blocks become the assistant's `reasoning_content`; `cache_control` is ignored, and Claude Code's
per-request attribution line (`x-anthropic-billing-header: ...; cch=<hash>;`, a block of its own
or the first line of the system text) is dropped, so the prompt prefix stays cacheable (field
reports D27, D28; vLLM does the same, PR 36829). `--keep-anthropic-billing-header` keeps it.
"""

from __future__ import annotations

import json
import re
from typing import Any

from dsaserve.server.anthropic.protocol import Block, MessagesRequest, TextBlock, ToolChoice
from dsaserve.web.errors import bad_request

BILLING_LINE = re.compile(r"^\s*x-anthropic-billing-header:[^\n]*(\n|$)")
SERVER_TOOL_PREFIXES = ("web_search_", "computer_", "bash_", "text_editor_", "code_execution_")
EFFORT = {"xhigh": "max"}


def to_chat_request(req: MessagesRequest, keep_billing_header: bool = False) -> dict:
    """The OpenAI chat request body equivalent to an Anthropic Messages request."""
    messages: list[dict] = []
    system = _system_text(req.system, keep_billing_header)
    if system:
        messages.append({"role": "system", "content": system})
    for i, message in enumerate(req.messages):
        messages += _convert(message.role, message.content, f"messages[{i}].content")
    body: dict[str, Any] = {
        "model": req.model, "messages": messages, "max_tokens": req.max_tokens,
        "stop": req.stop_sequences, "temperature": req.temperature, "top_p": req.top_p,
        "top_k": req.top_k, "stream": req.stream,
    }  # fmt: skip
    tools = [t for t in req.tools or [] if not _is_server_tool(t.type)]
    if tools:
        body["tools"] = [_tool(t) for t in tools]
    if req.tool_choice is not None:
        body["tool_choice"] = _tool_choice(req.tool_choice, bool(tools))
    kwargs: dict[str, Any] = {}
    if req.thinking is not None:
        kwargs["enable_thinking"] = req.thinking.type != "disabled"
        kwargs["thinking"] = kwargs["enable_thinking"]  # DeepSeek-V3.2's switch
    effort = req.output_config.effort if req.output_config is not None else None
    if effort is not None:
        body["reasoning_effort"] = EFFORT.get(effort, effort)
    if kwargs:
        body["chat_template_kwargs"] = kwargs
    return {k: v for k, v in body.items() if v is not None}


def _system_text(system: str | list[TextBlock] | None, keep_billing_header: bool = False) -> str:
    texts = (
        [system or ""] if system is None or isinstance(system, str) else [b.text for b in system]
    )
    if not keep_billing_header:
        stripped = [BILLING_LINE.sub("", t, count=1) for t in texts]
        texts = [new for new, old in zip(stripped, texts) if new or new == old]
    return "\n".join(texts)


def _convert(role: str, content: str | list[Block], param: str) -> list[dict]:
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if role == "assistant":
        return [_assistant(content, param)]
    out: list[dict] = []
    texts: list[str] = []
    for j, block in enumerate(content):
        if block.type == "text":
            texts.append(block.text or "")
        elif block.type == "tool_result" and role == "user":
            if texts:
                out.append({"role": role, "content": "".join(texts)})
                texts = []
            if not block.tool_use_id:
                raise bad_request("a tool_result block needs tool_use_id", f"{param}[{j}]")
            out.append({"role": "tool", "tool_call_id": block.tool_use_id,
                        "content": _result_text(block.content)})  # fmt: skip
        elif block.type in ("image", "document", "tool_use", "thinking", "redacted_thinking"):
            raise bad_request(f"{block.type} blocks are not supported for {role}", f"{param}[{j}]")
        # other block types (server-tool results, citations, ...) carry nothing to render
    if texts or not out:
        out.append({"role": role, "content": "".join(texts)})
    return out


def _assistant(blocks: list[Block], param: str) -> dict:
    texts, thinking, calls = [], [], []
    for j, block in enumerate(blocks):
        if block.type == "text":
            texts.append(block.text or "")
        elif block.type == "thinking":
            thinking.append(block.thinking or "")
        elif block.type == "tool_use":
            if not isinstance(block.input, dict):
                raise bad_request("tool_use input must be an object", f"{param}[{j}].input")
            calls.append({"id": block.id, "type": "function",
                          "function": {"name": block.name or "",
                                       "arguments": json.dumps(block.input)}})  # fmt: skip
        elif block.type in ("redacted_thinking", "image", "document", "tool_result"):
            raise bad_request(f"{block.type} blocks are not supported here", f"{param}[{j}]")
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
    if thinking:
        message["reasoning_content"] = "".join(thinking)
    if calls:
        message["tool_calls"] = calls
    return message


def _result_text(content: str | list[Block] | None) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    return "".join(b.text or "" for b in content if b.type == "text")


def _is_server_tool(kind: str | None) -> bool:
    return kind is not None and kind != "custom" and kind.startswith(SERVER_TOOL_PREFIXES)


def _tool(tool: Any) -> dict:
    schema = tool.input_schema or {"type": "object", "properties": {}}
    function = {"name": tool.name, "description": tool.description, "parameters": schema}
    return {"type": "function", "function": {k: v for k, v in function.items() if v is not None}}


def _tool_choice(choice: ToolChoice, has_tools: bool) -> Any:
    kind = choice.type
    if kind in ("any", "tool") and not has_tools:
        raise bad_request(f"tool_choice '{kind}' needs at least one custom tool", "tool_choice")
    if kind == "tool":
        if not choice.name:
            raise bad_request("tool_choice 'tool' needs a name", "tool_choice.name")
        return {"type": "function", "function": {"name": choice.name}}
    return {"auto": "auto", "any": "required", "none": "none"}[kind]
