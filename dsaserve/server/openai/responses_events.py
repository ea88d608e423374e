"""Parser events -> Responses output items, and the stream events that build them.

Both modes feed one `OutputItems` (non-streaming drops the events), so the streamed deltas add
up to the final items and every id (`rs_…`, `msg_…`, `fc_…`, the call's `call_…`) is the same in
`response.output_item.added`, `.done` and the final response. Per item, in OpenAI's order:

- reasoning: `output_item.added`, then with a summary asked for `reasoning_summary_part.added`,
  `reasoning_summary_text.delta`…, `.done`, `reasoning_summary_part.done` (the thinking as
  `summary_text`), else `content_part.added`, `reasoning_text.delta`…, `.done`,
  `content_part.done` (as `reasoning_text` content); `output_item.done`;
- message: `output_item.added`, `content_part.added`, `output_text.delta`…, `output_text.done`,
  `content_part.done`, `output_item.done`;
- function_call: `output_item.added`, `function_call_arguments.delta`…, `.done`,
  `output_item.done`.

`EventStream` numbers the events (`sequence_number` from 0) and writes them as SSE frames.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, NamedTuple

from dsaserve.server.parsers.events import Content, Event, Reasoning, ToolCallArgs, ToolCallStart

PREFIX = {"reasoning": "rs", "message": "msg", "function_call": "fc"}


class TextKind(NamedTuple):
    """How one kind of text item streams: its delta/done events, its part and where it goes."""

    event: str  # `<event>.delta`, `<event>.done`
    part_event: str  # `<part_event>.added`, `<part_event>.done`
    part: dict  # the empty part
    parts: str  # the item's list the part goes in
    index: str  # `content_index` or `summary_index`
    extra: dict  # more fields of the delta and done events


MESSAGE = TextKind(
    "response.output_text", "response.content_part",
    {"type": "output_text", "text": "", "annotations": [], "logprobs": []},
    parts="content", index="content_index", extra={"logprobs": []},
)  # fmt: skip
SUMMARY = TextKind(
    "response.reasoning_summary_text", "response.reasoning_summary_part",
    {"type": "summary_text", "text": ""}, parts="summary", index="summary_index", extra={},
)  # fmt: skip
REASONING = TextKind(
    "response.reasoning_text", "response.content_part",
    {"type": "reasoning_text", "text": ""}, parts="content", index="content_index", extra={},
)  # fmt: skip


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class OutputItems:
    """The output items of one response, built from its choice's parser events."""

    def __init__(self, summary: bool) -> None:
        self.reasoning = SUMMARY if summary else REASONING  # summary text if asked, else content
        self.items: list[dict] = []
        self.open: dict | None = None  # the item still being written
        self.text = ""  # the open item's text so far

    def feed(self, events: list[Event]) -> list[dict]:
        """Stream events for these parser events (items open and close as they go)."""
        out: list[dict] = []
        for event in events:
            if isinstance(event, Reasoning | Content):
                kind = "reasoning" if isinstance(event, Reasoning) else "message"
                if self.open is None or self.open["type"] != kind:
                    out += self.close() + self._open(kind)
                out.append(self._delta(event.text))
            elif isinstance(event, ToolCallStart):
                out += self.close() + self._open("function_call", event)
            elif isinstance(event, ToolCallArgs) and self._text_kind(self.open) is None:
                out.append(self._delta(event.fragment))  # a call's arguments follow its start
        return out

    def close(self, status: str = "completed") -> list[dict]:
        """Close the open item (`incomplete` when the output was cut off)."""
        item = self.open
        if item is None:
            return []
        self.open, text, kind = None, self.text, self._text_kind(item)
        item["status"] = status
        where = {"item_id": item["id"], "output_index": len(self.items) - 1}
        if kind is None:
            item["arguments"] = text
            out = [{"type": "response.function_call_arguments.done", **where, "arguments": text}]
        else:
            part = kind.part | {"text": text}
            item[kind.parts].append(part)
            text_done = {"type": f"{kind.event}.done", **where, kind.index: 0, "text": text}
            part_done = {"type": f"{kind.part_event}.done", **where, kind.index: 0, "part": part}
            out = [text_done | kind.extra, part_done]
        done = {"type": "response.output_item.done", "output_index": where["output_index"]}
        return out + [done | {"item": item}]

    def _text_kind(self, item: dict | None) -> TextKind | None:
        """The open text item's kind (None for a function call, or nothing open)."""
        if item is None or item["type"] == "function_call":
            return None
        return MESSAGE if item["type"] == "message" else self.reasoning

    def _open(self, kind: str, call: ToolCallStart | None = None) -> list[dict]:
        item: dict[str, Any] = {"id": new_id(PREFIX[kind]), "type": kind, "status": "in_progress"}
        if kind == "reasoning":
            item |= {"summary": []} if self.reasoning is SUMMARY else {"summary": [], "content": []}
        elif kind == "message":
            item |= {"role": "assistant", "content": []}
        else:
            item |= {"call_id": call.id, "name": call.name, "arguments": ""}
        self.items.append(item)
        self.open, self.text = item, ""
        where = {"output_index": len(self.items) - 1}
        out = [{"type": "response.output_item.added", **where, "item": _snapshot(item)}]
        text = self._text_kind(item)
        if text is not None:
            out.append({"type": f"{text.part_event}.added", "item_id": item["id"], **where,
                        text.index: 0, "part": dict(text.part)})  # fmt: skip
        return out

    def _delta(self, text: str) -> dict:
        item, kind = self.open, self._text_kind(self.open)
        self.text += text
        where = {"item_id": item["id"], "output_index": len(self.items) - 1}
        if kind is None:
            return {"type": "response.function_call_arguments.delta", **where, "delta": text}
        return {"type": f"{kind.event}.delta", **where, kind.index: 0, "delta": text, **kind.extra}


def _snapshot(item: dict) -> dict:
    """A copy of an item as it stands (the stream shows it before its parts are filled)."""
    return json.loads(json.dumps(item))


class EventStream:
    """Numbers a response's stream events and writes each as an SSE frame."""

    def __init__(self) -> None:
        self.sequence_number = 0

    def frame(self, event: dict) -> str:
        event["sequence_number"] = self.sequence_number
        self.sequence_number += 1
        return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"
