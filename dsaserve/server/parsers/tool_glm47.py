"""The `glm47` tool-call parser (GLM-4.7 / GLM-5.x): XML-ish calls to OpenAI tool calls.

Format: `<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value>…</tool_call>`, parallel
calls concatenated, `<tool_call>NAME</tool_call>` for no arguments. Streaming emits the name once
(as soon as it is complete) with an id `call_…`, then JSON text fragments of the arguments:
strings as they arrive, other values when their `</arg_value>` closes. The fragments of one call
concatenate to `json.dumps(arguments, ensure_ascii=False)` exactly. Calls to undeclared tools are
dropped; stray markup never reaches the content; an unterminated call is closed at the end,
unless the length limit cut it: then it stays as cut (see `finish`).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable

from dsaserve.grammar.tool_schema import allowed_types, convert_value, is_plain_string
from dsaserve.server.parsers.events import (
    Content,
    Event,
    ToolCallArgs,
    ToolCallStart,
    find_first,
    held_suffix,
)

CALL_START, CALL_END = "<tool_call>", "</tool_call>"
KEY_START, KEY_END = "<arg_key>", "</arg_key>"
VALUE_START, VALUE_END = "<arg_value>", "</arg_value>"
MARKUP = (CALL_START, CALL_END, KEY_START, KEY_END, VALUE_START, VALUE_END)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_properties(tools: list[dict]) -> dict[str, dict]:
    """Map each declared tool name to its parameters' `properties` schema."""
    table = {}
    for tool in tools:
        fn = tool.get("function", tool)
        params = fn.get("parameters")
        properties = params.get("properties") if isinstance(params, dict) else None
        table[str(fn.get("name", "")).strip()] = properties if isinstance(properties, dict) else {}
    return table


class Glm47ToolParser:
    """Streaming tool-call parser; feed content chunks, then call `finish()`."""

    def __init__(self, tools: list[dict], make_id: Callable[[], str] = new_call_id) -> None:
        self.tools = tool_properties(tools)
        self.make_id = make_id
        self.state = "text"
        self.buffer = ""
        self.num_calls = 0
        self._reset_call()

    def _reset_call(self) -> None:
        self.properties: dict = {}
        self.keys: set[str] = set()
        self.value_types: frozenset[str] | None = None
        self.skip_value = False

    def feed(self, text: str) -> list[Event]:
        self.buffer += text
        events: list[Event] = []
        while getattr(self, f"_step_{self.state}")(events):
            pass
        return events

    def finish(self, finish_type: str | None = None) -> list[Event]:
        """Close what is open; a call cut by the length limit (`finish_type` "length") is left
        as generated: its arguments end where the output ended, never completed with values
        nobody wrote (a call whose name was cut is left out)."""
        events: list[Event] = []
        cut = finish_type == "length"
        if cut and self.state == "text":  # a tag cut short is not text
            keep = held_suffix(self.buffer, MARKUP)
            self._content(events, self.buffer[: len(self.buffer) - keep])
        elif cut and self.state == "value" and self._streams_string():
            keep = held_suffix(self.buffer, (VALUE_END,))
            self._args(events, _escape(self.buffer[: len(self.buffer) - keep]))
        elif not cut:
            getattr(self, f"_finish_{self.state}")(events, self.buffer)
        self.buffer, self.state = "", "text"
        self._reset_call()
        return events

    # ---- steps: consume what is decided; return True to run again in the new state
    def _step_text(self, events: list[Event]) -> bool:
        pos, tag = find_first(self.buffer, MARKUP)
        if tag is None:
            keep = held_suffix(self.buffer, MARKUP)
            self._content(events, self.buffer[: len(self.buffer) - keep])
            self.buffer = self.buffer[len(self.buffer) - keep :]
            return False
        self._content(events, self.buffer[:pos])
        self.buffer = self.buffer[pos + len(tag) :]
        if tag == CALL_START:
            self.state = "name"
        return True  # stray markup outside a call is dropped

    def _step_name(self, events: list[Event]) -> bool:
        pos, tag = find_first(self.buffer, (KEY_START, CALL_END))
        if tag is None:
            return False
        name = self._clean_name(self.buffer[:pos])
        self.buffer = self.buffer[pos + len(tag) :]
        if name not in self.tools:
            self.state = "skip" if tag == KEY_START else "text"
            return True
        self._start_call(events, name)
        if tag == CALL_END:
            self._end_call(events)
        else:
            self.state = "key"
        return True

    def _step_key(self, events: list[Event]) -> bool:
        pos = self.buffer.find(KEY_END)
        if pos == -1:
            return False
        key = self._clean_name(self.buffer[:pos])
        self.buffer = self.buffer[pos + len(KEY_END) :]
        self.skip_value = key in self.keys
        if not self.skip_value:
            prefix = "{" if not self.keys else ", "
            self.keys.add(key)
            self._args(events, f"{prefix}{json.dumps(key, ensure_ascii=False)}: ")
            self.value_types = allowed_types(self.properties.get(key))
        self.state = "wait_value"
        return True

    def _step_wait_value(self, events: list[Event]) -> bool:
        pos, tag = find_first(self.buffer, (VALUE_START, CALL_END))
        if tag is None:
            return False
        self.buffer = self.buffer[pos + len(tag) :]
        if tag == CALL_END:
            self._finish_wait_value(events, "")
            self.state = "text"
            return True
        self.state = "value"
        if self._streams_string():
            self._args(events, '"')
        return True

    def _step_value(self, events: list[Event]) -> bool:
        pos = self.buffer.find(VALUE_END)
        if pos == -1:
            if self._streams_string():
                keep = held_suffix(self.buffer, (VALUE_END,))
                self._args(events, _escape(self.buffer[: len(self.buffer) - keep]))
                self.buffer = self.buffer[len(self.buffer) - keep :]
            return False
        raw, self.buffer = self.buffer[:pos], self.buffer[pos + len(VALUE_END) :]
        self._close_value(events, raw)
        self.state = "between"
        return True

    def _step_between(self, events: list[Event]) -> bool:
        pos, tag = find_first(self.buffer, (KEY_START, CALL_END))
        if tag is None:
            keep = held_suffix(self.buffer, (KEY_START, CALL_END))
            self.buffer = self.buffer[len(self.buffer) - keep :]
            return False
        self.buffer = self.buffer[pos + len(tag) :]
        if tag == CALL_END:
            self._end_call(events)
        else:
            self.state = "key"
        return True

    def _step_skip(self, events: list[Event]) -> bool:
        pos = self.buffer.find(CALL_END)
        if pos == -1:
            self.buffer = self.buffer[len(self.buffer) - held_suffix(self.buffer, (CALL_END,)) :]
            return False
        self.buffer = self.buffer[pos + len(CALL_END) :]
        self.state = "text"
        return True

    # ---- finish: close whatever is open, leniently
    def _finish_text(self, events: list[Event], rest: str) -> None:
        self._content(events, rest)

    def _finish_name(self, events: list[Event], rest: str) -> None:
        name = self._clean_name(rest[: len(rest) - held_suffix(rest, (KEY_START, CALL_END))])
        if name in self.tools:
            self._start_call(events, name)
            self._end_call(events)

    def _finish_key(self, events: list[Event], rest: str) -> None:
        self._end_call(events)

    def _finish_wait_value(self, events: list[Event], rest: str) -> None:
        if not self.skip_value:
            self._args(events, "null")
        self._end_call(events)

    def _finish_value(self, events: list[Event], rest: str) -> None:
        if self._streams_string():
            self._step_value(events)
            rest = self.buffer
        self._close_value(events, rest)
        self._end_call(events)

    def _finish_between(self, events: list[Event], rest: str) -> None:
        self._end_call(events)

    def _finish_skip(self, events: list[Event], rest: str) -> None:
        pass

    # ---- helpers
    def _streams_string(self) -> bool:
        return not self.skip_value and is_plain_string(self.value_types)

    def _close_value(self, events: list[Event], raw: str) -> None:
        if self.skip_value:
            return
        if self._streams_string():
            self._args(events, _escape(raw) + '"')
        else:
            value = convert_value(raw, self.value_types)
            self._args(events, json.dumps(value, ensure_ascii=False))

    def _start_call(self, events: list[Event], name: str) -> None:
        self._reset_call()
        self.properties = self.tools[name]
        events.append(ToolCallStart(self.num_calls, self.make_id(), name))

    def _end_call(self, events: list[Event]) -> None:
        self._args(events, "}" if self.keys else "{}")
        self.num_calls += 1
        self._reset_call()
        self.state = "text"

    def _args(self, events: list[Event], fragment: str) -> None:
        events.append(ToolCallArgs(self.num_calls, fragment))

    def _content(self, events: list[Event], text: str) -> None:
        if text:
            events.append(Content(text))

    @staticmethod
    def _clean_name(text: str) -> str:
        for tag in MARKUP:
            text = text.replace(tag, "")
        return text.strip()


def _escape(text: str) -> str:
    """JSON-escape a piece of a string value (JSON escapes character by character)."""
    return json.dumps(text, ensure_ascii=False)[1:-1]


class Glm45ToolParser(Glm47ToolParser):
    """GLM-4.5/4.6 layout (newlines after the name and between tags; whitespace is skipped the
    same way); as in sglang's `glm45`, content after the first call is not returned."""

    def _content(self, events: list[Event], text: str) -> None:
        if self.num_calls == 0 and self.state == "text":
            super()._content(events, text)
