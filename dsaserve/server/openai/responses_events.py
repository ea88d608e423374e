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
from typing import Any

from dsaserve.server.parsers.events import Content, Event, Reasoning, ToolCallArgs, ToolCallStart

PREFIX = {"reasoning": "rs", "message": "msg", "function_call": "fc"}


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class OutputItems:
    """The output items of one response, built from its choice's parser events."""

    def __init__(self, summary: bool) -> None:
        self.summary = summary  # reasoning as summary text (asked for), else as content
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
            elif isinstance(event, ToolCallArgs) and self._open_call():
                out.append(self._delta(event.fragment))  # a call's arguments follow its start
        return out

    def close(self, status: str = "completed") -> list[dict]:
        """Close the open item (`incomplete` when the output was cut off)."""
        item = self.open
        if item is None:
            return []
        self.open, text = None, self.text
        item["status"] = status
        where = {"item_id": item["id"], "output_index": len(self.items) - 1}
        if item["type"] == "function_call":
            item["arguments"] = text
            out = [{"type": "response.function_call_arguments.done", **where, "arguments": text}]
        else:
            part, out = self._part(item["type"], text), self._text_done(item, where, text)
            out.append({"type": self._part_event(item, "done"), **where, **self._part_index(item),
                        "part": part})  # fmt: skip
            self._parts(item).append(part)
        return out + [{"type": "response.output_item.done", "output_index": where["output_index"],
                       "item": item}]  # fmt: skip

    # ---- the open item
    def _open_call(self) -> bool:
        return self.open is not None and self.open["type"] == "function_call"

    def _open(self, kind: str, call: ToolCallStart | None = None) -> list[dict]:
        item: dict[str, Any] = {"id": new_id(PREFIX[kind]), "type": kind, "status": "in_progress"}
        if kind == "reasoning":
            item |= {"summary": []} if self.summary else {"summary": [], "content": []}
        elif kind == "message":
            item |= {"role": "assistant", "content": []}
        else:
            item |= {"call_id": call.id, "name": call.name, "arguments": ""}
        self.items.append(item)
        self.open, self.text = item, ""
        where = {"output_index": len(self.items) - 1}
        out = [{"type": "response.output_item.added", **where, "item": _snapshot(item)}]
        if kind != "function_call":
            out.append({"type": self._part_event(item, "added"), "item_id": item["id"], **where,
                        **self._part_index(item), "part": self._part(kind, "")})  # fmt: skip
        return out

    def _delta(self, text: str) -> dict:
        item = self.open
        self.text += text
        where = {"item_id": item["id"], "output_index": len(self.items) - 1}
        if item["type"] == "function_call":
            return {"type": "response.function_call_arguments.delta", **where, "delta": text}
        if item["type"] == "message":
            return {"type": "response.output_text.delta", **where, "content_index": 0,
                    "delta": text, "logprobs": []}  # fmt: skip
        if self.summary:
            return {"type": "response.reasoning_summary_text.delta", **where, "summary_index": 0,
                    "delta": text}  # fmt: skip
        return {"type": "response.reasoning_text.delta", **where, "content_index": 0, "delta": text}

    def _text_done(self, item: dict, where: dict, text: str) -> list[dict]:
        if item["type"] == "message":
            return [{"type": "response.output_text.done", **where, "content_index": 0,
                     "text": text, "logprobs": []}]  # fmt: skip
        if self.summary:
            return [{"type": "response.reasoning_summary_text.done", **where, "summary_index": 0,
                     "text": text}]  # fmt: skip
        return [{"type": "response.reasoning_text.done", **where, "content_index": 0, "text": text}]

    def _part(self, kind: str, text: str) -> dict:
        if kind == "message":
            return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
        return {"type": "summary_text" if self.summary else "reasoning_text", "text": text}

    def _parts(self, item: dict) -> list:
        return item["summary"] if item["type"] == "reasoning" and self.summary else item["content"]

    def _part_event(self, item: dict, stage: str) -> str:
        if item["type"] == "reasoning" and self.summary:
            return f"response.reasoning_summary_part.{stage}"
        return f"response.content_part.{stage}"

    def _part_index(self, item: dict) -> dict:
        if item["type"] == "reasoning" and self.summary:
            return {"summary_index": 0}
        return {"content_index": 0}


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
