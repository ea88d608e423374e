"""Responses request -> chat request body: the Responses API is one more envelope on the chat
pipeline (same template, parsers, grammar and engine), as the Anthropic route is.

Items become chat messages in order: `instructions` leads as a system message; `user`, `system`
and `developer` messages map one to one; the assistant-side items of one turn (a `reasoning`
item, an assistant `message`, `function_call`s) become one assistant message with
`reasoning_content`, `content` and `tool_calls`, so the GLM or DeepSeek template renders the turn
exactly as for chat; a `function_call_output` becomes a `tool` message. Function tools (flat in
the Responses shape) become chat tools. Tools and items the model cannot run or see (`web_search`,
`namespace`, `custom`, hosted-tool calls, ...) are left out and named in `left_out`, for the
route's warning line, so a client like Codex that always sends them still works.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from dsaserve.server.openai.responses_protocol import (
    InputItem,
    ResponsesRequest,
    ResponsesTool,
    ToolChoiceObject,
)
from dsaserve.web.errors import bad_request

TEXT_PARTS = ("input_text", "output_text", "text")
MEDIA_PARTS = ("input_image", "input_file", "input_audio")
EFFORT = {"minimal": "low", "xhigh": "max"}  # the GLM templates know low / high / max


@dataclass
class ChatTranslation:
    body: dict  # a ChatCompletionRequest body
    left_out: list[str] = field(default_factory=list)  # tool and item types not rendered


def request_items(req: ResponsesRequest) -> list[InputItem]:
    """The request's own input as items (a string is one user message)."""
    if isinstance(req.input, str):
        return [InputItem(type="message", role="user", content=req.input)]
    return list(req.input or [])


def to_chat_body(req: ResponsesRequest, history: list[InputItem]) -> ChatTranslation:
    """The chat request equivalent to `req` continuing `history` (previous_response_id's items,
    which OpenAI renders without the earlier `instructions`)."""
    out = ChatTranslation(body={})
    messages = [{"role": "system", "content": req.instructions}] if req.instructions else []
    messages += _messages([*history, *request_items(req)], len(history), out.left_out)
    if not messages:
        raise bad_request("give input (a string or items), or instructions", "input")
    tools = _tools(req.tools, out.left_out)
    tool_choice, tools = _tool_choice(req.tool_choice, tools)
    effort = req.reasoning.effort if req.reasoning is not None else None
    body = {
        "model": req.model, "messages": messages, "max_tokens": req.max_output_tokens,
        "temperature": req.temperature, "top_p": req.top_p, "stream": req.stream,
        "tools": tools or None, "tool_choice": tool_choice,
        "parallel_tool_calls": req.parallel_tool_calls, "response_format": _format(req),
        "reasoning_effort": EFFORT.get(effort, effort) if effort else None,
        "chat_template_kwargs": req.chat_template_kwargs,
    }  # fmt: skip
    out.body = {k: v for k, v in body.items() if v is not None}
    return out


def _messages(items: list[InputItem], own_from: int, left_out: list[str]) -> list[dict]:
    messages: list[dict] = []
    turn: dict | None = None  # the assistant turn being gathered

    def flush() -> None:
        nonlocal turn
        if turn is not None:
            messages.append(turn)
            turn = None

    for i, item in enumerate(items):
        param = f"input[{i - own_from}]" if i >= own_from else "previous_response_id"
        kind = item.type or "message"
        if kind == "message" and item.role is None:
            raise bad_request("a message item needs a role", f"{param}.role")
        if kind == "message" and item.role != "assistant":
            flush()
            messages.append({"role": item.role, "content": _text(item.content, f"{param}.content")})
        elif kind == "message":
            if turn is not None and (turn["content"] or "tool_calls" in turn):
                flush()
            turn = turn or {"role": "assistant", "content": ""}
            turn["content"] = _text(item.content, f"{param}.content")
        elif kind == "reasoning":
            flush()
            turn = {"role": "assistant", "content": "", "reasoning_content": _reasoning(item)}
        elif kind == "function_call":
            turn = turn or {"role": "assistant", "content": ""}
            turn.setdefault("tool_calls", []).append(_call(item, param))
        elif kind == "function_call_output":
            flush()
            if not item.call_id:
                raise bad_request("a function_call_output needs call_id", f"{param}.call_id")
            messages.append({"role": "tool", "tool_call_id": item.call_id,
                             "content": _text(item.output, f"{param}.output")})  # fmt: skip
        elif kind == "item_reference":
            raise bad_request("item_reference is not supported: send the item itself", param)
        else:
            left_out.append(f"{kind} item")
    flush()
    return messages


def _text(content: str | list | None, param: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for j, part in enumerate(content):
        if part.type in TEXT_PARTS:
            texts.append(part.text or "")
        elif part.type == "refusal":
            texts.append(part.refusal or part.text or "")
        elif part.type in MEDIA_PARTS:
            raise bad_request(f"{part.type} parts are not supported: this server serves a "
                              "text-only model", f"{param}[{j}]")  # fmt: skip
        else:
            raise bad_request(f"content part type '{part.type[:40]}' is not supported here",
                              f"{param}[{j}].type")  # fmt: skip
    return "".join(texts)


def _reasoning(item: InputItem) -> str:
    """The thinking text: the `reasoning_text` content, else the summaries."""
    content = item.content if isinstance(item.content, list) else []
    texts = [p.text or "" for p in content if p.type == "reasoning_text"]
    if any(texts):
        return "".join(texts)
    return "\n\n".join(p.text or "" for p in item.summary or [] if p.type == "summary_text")


def _call(item: InputItem, param: str) -> dict:
    if not item.call_id or not item.name:
        raise bad_request("a function_call needs call_id and name", f"{param}.call_id")
    try:
        arguments = json.loads(item.arguments) if item.arguments else {}
    except ValueError as e:
        raise bad_request("arguments are not valid JSON", f"{param}.arguments") from e
    if not isinstance(arguments, dict):
        raise bad_request("arguments must be a JSON object", f"{param}.arguments")
    return {"id": item.call_id, "type": "function",
            "function": {"name": item.name, "arguments": arguments}}  # fmt: skip


def _tools(tools: list[ResponsesTool] | None, left_out: list[str]) -> list[dict]:
    out = []
    for i, tool in enumerate(tools or []):
        if tool.type != "function":
            left_out.append(f"{tool.type} tool" + (f" {tool.name}" if tool.name else ""))
            continue
        if not tool.name:
            raise bad_request("a function tool needs a name", f"tools[{i}].name")
        function = {"name": tool.name, "description": tool.description,
                    "parameters": tool.parameters, "strict": tool.strict}  # fmt: skip
        out.append({"type": "function",
                    "function": {k: v for k, v in function.items() if v is not None}})  # fmt: skip
    return out


def _tool_choice(choice: str | ToolChoiceObject | None, tools: list[dict]) -> tuple[Any, list]:
    """Chat's tool_choice (and the tools it leaves offered)."""
    if choice is None or isinstance(choice, str):
        return choice, tools
    if choice.type == "function":
        if not choice.name:
            raise bad_request("a function tool_choice needs a name", "tool_choice.name")
        return {"type": "function", "function": {"name": choice.name}}, tools
    if choice.type == "allowed_tools":
        names = {t.name for t in choice.tools or [] if t.type == "function"}
        return choice.mode or "auto", [t for t in tools if t["function"]["name"] in names]
    raise bad_request(f"tool_choice type '{choice.type[:40]}' names a tool this server cannot "
                      "run; give auto, none, required, a function or allowed_tools",
                      "tool_choice")  # fmt: skip


def _format(req: ResponsesRequest) -> dict | None:
    fmt = req.text.format if req.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    if fmt.schema_ is None:
        raise bad_request("a json_schema text format needs schema", "text.format.schema")
    spec = {"name": fmt.name, "description": fmt.description, "schema": fmt.schema_,
            "strict": fmt.strict}  # fmt: skip
    return {"type": "json_schema", "json_schema": {k: v for k, v in spec.items() if v is not None}}
