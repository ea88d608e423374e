"""The `deepseekv32` tool-call parser: DeepSeek-V3.2's DSML tool calls to OpenAI tool calls.

Format (after the content, as the checkpoint's encoder renders history):
    <｜DSML｜function_calls>
    <｜DSML｜invoke name="NAME">
    <｜DSML｜parameter name="KEY" string="true|false">VALUE</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜function_calls>
`string="true"` values are raw text, the others JSON; the tool's declared schema has the last
word, as for GLM (a string stays a string even if it reads "12345", an integer decodes). An invoke
whose body is a JSON object (no parameter tags) takes that object as its arguments.

Leniency (field reports A12, A13; sglang#40236): an `invoke` without the section, a section or an
invoke that never closes, a sibling invoke opened before the previous one closed, attributes
without quotes or without `string`: each still becomes a tool call, never `content`. Every DSML
tag is markup: stray ones are dropped, text inside a section between tags is dropped. Streaming
emits the name as soon as the invoke tag is complete, then JSON fragments (strings as they
arrive, other values when their parameter closes) that concatenate to the arguments object.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass

from dsaserve.grammar.tool_schema import allowed_types, convert_value, is_plain_string
from dsaserve.server.parsers.events import (
    Content,
    Event,
    ToolCallArgs,
    ToolCallStart,
    find_first,
    held_suffix,
)
from dsaserve.server.parsers.tool_glm47 import _escape, new_call_id, tool_properties

DSML = "｜DSML｜"
TAG_STARTS = (f"<{DSML}", f"</{DSML}")
REASONING_EXITS = (f"<{DSML}function_calls", f"<{DSML}invoke")  # a call ends thinking
_KIND = re.compile(r"\s*([A-Za-z_]+)")
_ATTR = re.compile(r'([A-Za-z_]+)\s*=\s*(?:"([^"]*)"?|([^\s">]+))')


@dataclass
class Tag:
    closing: bool
    kind: str  # function_calls, invoke, parameter (anything else is ignored)
    attrs: dict[str, str]


def parse_tag(text: str) -> Tag:
    """A DSML tag from its text, `<｜DSML｜invoke name="x">` (the `>` may be missing)."""
    closing = text.startswith("</")
    body = text[len(TAG_STARTS[1] if closing else TAG_STARTS[0]) :].removesuffix(">")
    kind = _KIND.match(body)
    rest = body[kind.end() :] if kind else body
    attrs: dict[str, str] = {}
    for m in _ATTR.finditer(rest):
        attrs.setdefault(m.group(1), m.group(2) if m.group(2) is not None else m.group(3))
    if "name" not in attrs and rest.strip():  # `<｜DSML｜invoke get_weather>`
        attrs["name"] = rest.strip().strip('"')
    return Tag(closing, kind.group(1) if kind else "", attrs)


class DsmlToolParser:
    """Streaming DSML parser; feed content chunks, then call `finish()`."""

    def __init__(self, tools: list[dict], make_id: Callable[[], str] = new_call_id) -> None:
        self.tools = tool_properties(tools)
        self.make_id = make_id
        self.buffer = ""
        self.state = "text"  # text | section | invoke | value
        self.in_section = False
        self.num_calls = 0
        self._reset_call()

    def _reset_call(self) -> None:
        self.call_open = False  # an invoke is open (declared tool or not)
        self.known = False  # ... and it names a declared tool
        self.properties: dict = {}
        self.keys: set[str] = set()
        self.loose = ""  # invoke body outside parameter tags (a JSON-object body)
        self._reset_value(skip=True)

    def _reset_value(self, skip: bool, types: frozenset[str] | None = None) -> None:
        self.skip_value, self.value_types = skip, types
        self.value_string, self.string_attr, self.value_raw = False, None, ""

    def feed(self, text: str) -> list[Event]:
        self.buffer += text
        events: list[Event] = []
        while self._step(events):
            pass
        return events

    def finish(self, finish_type: str | None = None) -> list[Event]:
        """Close what is open; a call cut by the length limit (`finish_type` "length") is left
        as generated (as in the glm47 parser)."""
        events: list[Event] = []
        rest, self.buffer = self.buffer, ""
        if finish_type == "length":  # cut: what was written, no tag cut short, nothing closed
            if not rest.startswith(TAG_STARTS) and DSML[:2] not in rest:
                self._text(events, rest)
            self._reset_call()
            self.state, self.in_section = "text", False
            return events
        if rest.startswith(TAG_STARTS):
            self._on_tag(events, parse_tag(rest))  # a tag cut off before its `>`
        elif DSML[:2] not in rest:
            self._text(events, rest)  # held text that was not a tag start after all
        if self.state == "value":
            self._close_value(events)
        if self.call_open:
            self._end_call(events)
        self.state, self.in_section = "text", False
        return events

    def _step(self, events: list[Event]) -> bool:
        pos, start = find_first(self.buffer, TAG_STARTS)
        if start is None:
            keep = held_suffix(self.buffer, TAG_STARTS)
            self._text(events, self.buffer[: len(self.buffer) - keep])
            self.buffer = self.buffer[len(self.buffer) - keep :]
            return False
        self._text(events, self.buffer[:pos])
        self.buffer = self.buffer[pos:]
        end, mark = find_first(self.buffer[1:], (">", "<"))
        if mark is None:
            return False  # wait for the rest of the tag
        end += 1 if mark == "<" else 2  # a `<` first: the tag lost its `>`
        tag, self.buffer = parse_tag(self.buffer[:end]), self.buffer[end:]
        self._on_tag(events, tag)
        return True

    # ---- text between tags, by state
    def _text(self, events: list[Event], text: str) -> None:
        if not text:
            return
        if self.state == "text":
            events.append(Content(text))
        elif self.state == "invoke" and not self.keys:
            self.loose += text
        elif self.state == "value" and not self.skip_value:
            if self.value_string:
                self._args(events, _escape(text))
            else:
                self.value_raw += text

    # ---- tags, by state
    def _on_tag(self, events: list[Event], tag: Tag) -> None:
        if self.state == "value":
            self._close_value(events)
            self.state = "invoke" if self.call_open else self._outside()
            if tag.kind == "parameter" and tag.closing:
                return
        opening = not tag.closing
        if tag.kind == "function_calls":
            if self.call_open:
                self._end_call(events)
            self.in_section = opening
            self.state = self._outside()
        elif tag.kind == "invoke":
            if self.call_open:
                self._end_call(events)  # closed, or a sibling opened before it closed
            if opening:
                self._open_invoke(events, tag.attrs.get("name", ""))
            self.state = "invoke" if opening else self._outside()
        elif tag.kind == "parameter" and opening:
            self._open_parameter(events, tag.attrs)
            self.state = "value"

    def _outside(self) -> str:
        return "section" if self.in_section else "text"

    def _open_invoke(self, events: list[Event], raw_name: str) -> None:
        self._reset_call()
        name = raw_name.strip()
        self.call_open, self.known = True, name in self.tools
        if self.known:
            self.properties = self.tools[name]
            events.append(ToolCallStart(self.num_calls, self.make_id(), name))

    def _open_parameter(self, events: list[Event], attrs: dict[str, str]) -> None:
        key = attrs.get("name", "").strip()
        if not (self.call_open and self.known and key) or key in self.keys:
            self._reset_value(skip=True)
            return
        self._args(events, ("{" if not self.keys else ", ") + json.dumps(key, ensure_ascii=False))
        self._args(events, ": ")
        self.keys.add(key)
        self._reset_value(skip=False, types=allowed_types(self.properties.get(key)))
        self.string_attr = attrs.get("string")
        self.value_string = is_plain_string(self.value_types) or (
            self.value_types is None and self.string_attr == "true"
        )
        if self.value_string:
            self._args(events, '"')

    def _close_value(self, events: list[Event]) -> None:
        if self.skip_value:
            pass
        elif self.value_string:
            self._args(events, '"')
        else:
            value = convert_value(self.value_raw, self.value_types)
            try:
                text = json.dumps(value, ensure_ascii=False)
            except TypeError:  # e.g. a Python set literal
                text = json.dumps(self.value_raw, ensure_ascii=False)
            self._args(events, text)
        self._reset_value(skip=True)

    def _end_call(self, events: list[Event]) -> None:
        if self.known:
            self._args(events, "}" if self.keys else self._loose_arguments())
            self.num_calls += 1
        self._reset_call()

    def _loose_arguments(self) -> str:
        try:
            body = json.loads(self.loose)
        except ValueError:
            return "{}"
        return json.dumps(body, ensure_ascii=False) if isinstance(body, dict) else "{}"

    def _args(self, events: list[Event], fragment: str) -> None:
        events.append(ToolCallArgs(self.num_calls, fragment))
