"""DeepSeek-V3.2's prompt format: messages -> the exact prompt text its own encoder writes.

DeepSeek-V3.2 ships no Jinja chat template. Its checkpoint carries a Python encoder
(`encoding/encoding_dsv32.py`, with golden outputs `encoding/test_output*.txt`), which sglang
serves through a copy (`entrypoints/openai/encoding_dsv32.py`). This module is our own
implementation of the same rules:

- `<｜begin▁of▁sentence｜>` once; system text (plus the tool block and a response format) bare;
  each user turn `<｜User｜>TEXT<｜Assistant｜>` then `<think>` if it is the last user turn and
  thinking is on, else `</think>`;
- an assistant turn: `REASONING</think>` only after the last user turn in thinking mode, then the
  content, then `\\n\\n<｜DSML｜function_calls>…</｜DSML｜function_calls>` for its tool calls, then
  `<｜end▁of▁sentence｜>`; older reasoning is dropped in thinking mode;
- tool results `\\n\\n<function_results>\\n<result>…</result>…\\n</function_results>`, then `\\n\\n`
  and `<think>` (thinking, after the last user turn) or `</think>`.

`render_chat` adds sglang's request glue: an empty system turn first when there is none (it
carries the tools), and a trailing assistant turn sent as a user turn.
"""

from __future__ import annotations

import json
from typing import Any

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK_START, THINK_END = "<think>", "</think>"
DSML = "｜DSML｜"

TOOLS_BLOCK = (
    "## Tools\n\nYou have access to a set of tools you can use to answer the user's question.\n"
    f'You can invoke functions by writing a "<{DSML}function_calls>" block like the following '
    "as part of your reply to the user:\n"
    f"<{DSML}function_calls>\n"
    f'<{DSML}invoke name="$FUNCTION_NAME">\n'
    f'<{DSML}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE'
    f"</{DSML}parameter>\n...\n</{DSML}invoke>\n"
    f'<{DSML}invoke name="$FUNCTION_NAME2">\n...\n</{DSML}invoke>\n'
    f"</{DSML}function_calls>\n\n"
    "String and scalar parameters should be specified as is without any escaping or quotes, "
    'while lists and objects should use JSON format. The "string" attribute should be set to '
    '"true" for string type parameters and "false" for other types (numbers, booleans, arrays, '
    "objects).\n\n"
    "If the thinking_mode is enabled, then after function results you should strongly consider "
    "outputting a thinking block. Here is an example:\n\n"
    f"<{DSML}function_calls>\n...\n</{DSML}function_calls>\n\n"
    "<function_results>\n...\n</function_results>\n\n"
    f"{THINK_START}...thinking about results{THINK_END}\n\n"
    "Here are the functions available in JSONSchema format:\n<functions>\n{schemas}\n"
    "</functions>\n"
)
RESPONSE_FORMAT = (
    "## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n{schema}"
)


class EncodingError(ValueError):
    """A conversation the DeepSeek-V3.2 format cannot express."""


def render_chat(messages: list[dict], tools: list[dict] | None, thinking: bool) -> str:
    """The prompt sglang sends for an OpenAI chat request to DeepSeek-V3.2."""
    turns = [dict(m) for m in messages]
    if turns and turns[-1].get("role") == "assistant":
        turns[-1] = {"role": "user", "content": turns[-1].get("content") or ""}
    if not turns or turns[0].get("role") != "system":
        turns.insert(0, {"role": "system", "content": ""})
    if tools:
        turns[0]["tools"] = tools
    return encode_messages(turns, thinking)


def encode_messages(
    messages: list[dict],
    thinking: bool,
    context: list[dict] | None = None,
    drop_thinking: bool = True,
    add_bos: bool = True,
) -> str:
    """The encoder's `encode_messages` (thinking_mode "thinking" when `thinking`, else "chat"):
    renders `messages` after an already rendered `context`."""
    context = context or []
    full = context + messages
    if thinking and drop_thinking:
        full = _drop_old_reasoning(full)
    prompt = BOS if add_bos and not context else ""
    for index in range(len(context), len(context) + len(messages)):
        prompt += _render(index, full, thinking)
    return prompt


def _render(index: int, messages: list[dict], thinking: bool) -> str:
    if not 0 <= index < len(messages):
        raise EncodingError(f"message {index} is out of range")
    message, last_user = messages[index], _last_user_index(messages)
    role = message.get("role")
    if role == "system":
        return (message.get("content") or "") + _extras(message)
    if role in ("user", "developer"):
        text = _developer_text(message) if role == "developer" else message.get("content") or ""
        opened = THINK_START if index == last_user and thinking else THINK_END
        return f"{USER}{text}{ASSISTANT}{opened}"
    if role == "tool":
        return _tool_result(index, messages, thinking and index >= last_user)
    if role == "assistant":
        return _assistant(message, thinking and index > last_user)
    raise EncodingError(f"unknown role {role!r}")


def _extras(message: dict) -> str:
    """The tool block and the response format a system (or developer) turn carries."""
    text = ""
    if message.get("tools"):
        schemas = "\n".join(to_json(tool["function"]) for tool in message["tools"])
        text += "\n\n" + TOOLS_BLOCK.format(schemas=schemas)
    if message.get("response_format"):
        text += "\n\n" + RESPONSE_FORMAT.format(schema=to_json(message["response_format"]))
    return text


def _developer_text(message: dict) -> str:
    if not message.get("content"):
        raise EncodingError("a developer message needs content")
    return _extras(message) + f"\n\n# The user's message is: {message['content']}"


def _tool_result(index: int, messages: list[dict], open_thinking: bool) -> str:
    caller = index - 1
    while caller >= 0 and messages[caller].get("role") == "tool":
        caller -= 1
    if caller < 0 or messages[caller].get("role") != "assistant":
        raise EncodingError(f"tool message {index} does not follow an assistant tool call")
    order, calls = index - caller, messages[caller].get("tool_calls") or []
    if len(calls) < order:
        raise EncodingError(f"tool message {index} has no matching tool call")
    text = "\n\n<function_results>" if order == 1 else ""
    text += f"\n<result>{messages[index].get('content')}</result>"
    if order == len(calls):
        text += "\n</function_results>\n\n" + (THINK_START if open_thinking else THINK_END)
    return text


def _assistant(message: dict, shows_reasoning: bool) -> str:
    calls = message.get("tool_calls") or []
    reasoning = ""
    if shows_reasoning:
        if not (message.get("reasoning_content") or calls):
            raise EncodingError(
                "in thinking mode an assistant message after the last user message needs "
                "reasoning_content or tool_calls"
            )
        reasoning = (message.get("reasoning_content") or "") + THINK_END
    text = reasoning + (message.get("content") or "")
    if calls:
        invokes = "\n".join(_invoke(call) for call in calls)
        text += f"\n\n<{DSML}function_calls>\n{invokes}\n</{DSML}function_calls>"
    return text + EOS


def _invoke(call: dict) -> str:
    function = call["function"]
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        arguments = json.loads(arguments)
    if not isinstance(arguments, dict):
        raise EncodingError("tool-call arguments must be a JSON object")
    params = "\n".join(_parameter(key, value) for key, value in arguments.items())
    return f'<{DSML}invoke name="{function.get("name")}">\n{params}\n</{DSML}invoke>'


def _parameter(key: str, value: Any) -> str:
    is_str = isinstance(value, str)
    text = value if is_str else to_json(value)
    flag = "true" if is_str else "false"
    return f'<{DSML}parameter name="{key}" string="{flag}">{text}</{DSML}parameter>'


def _drop_old_reasoning(messages: list[dict]) -> list[dict]:
    """Thinking mode keeps reasoning only from the last user turn on (as the encoder does, a
    developer turn before it is dropped too)."""
    last_user = _last_user_index(messages)
    kept = []
    for index, message in enumerate(messages):
        role = message.get("role")
        if role in ("user", "system", "tool") or index >= last_user:
            kept.append(message)
        elif role == "assistant":
            kept.append({k: v for k, v in message.items() if k != "reasoning_content"})
    return kept


def _last_user_index(messages: list[dict]) -> int:
    for index in range(len(messages) - 1, -1, -1):
        if messages[index].get("role") in ("user", "developer"):
            return index
    return -1


def to_json(value: Any) -> str:
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError, UnicodeEncodeError):
        return json.dumps(value, ensure_ascii=True)
