"""One choice's output pipeline: reasoning parser, then tool parser, then content tidying.

Streaming calls `feed` per engine delta; non-streaming feeds the whole text once. Both read the
same events, so the streamed deltas always add up to the non-streamed message.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dsaserve.server.parsers.events import (
    Content,
    Event,
    Reasoning,
    ToolCallArgs,
    ToolCallStart,
    merge_events,
)
from dsaserve.server.parsers.reasoning import Glm45ReasoningParser
from dsaserve.server.parsers.tool_dsml import DsmlToolParser
from dsaserve.server.parsers.tool_glm47 import Glm47ToolParser

# Role and end-of-text markers the engine may leave in the text when special tokens are kept.
END_MARKERS = ("<|endoftext|>", "<|user|>", "<|observation|>", "<|assistant|>", "<eop>",
               "<｜end▁of▁sentence｜>")  # fmt: skip


@dataclass
class ParsedCall:
    id: str
    name: str
    arguments: str = ""


@dataclass
class ParsedMessage:
    """The non-streamed view of a choice: what the concatenated deltas add up to."""

    reasoning: str | None = None
    content: str | None = None
    tool_calls: list[ParsedCall] = field(default_factory=list)


class ChatOutputParser:
    """Reasoning split, tool-call extraction and content strip for one choice."""

    def __init__(
        self,
        reasoning: Glm45ReasoningParser | None = None,
        tools: Glm47ToolParser | DsmlToolParser | None = None,
    ) -> None:
        self.reasoning = reasoning
        self.tools = tools
        self.content_started = False
        self.pending_space = ""
        self.num_calls = 0

    def feed(self, text: str) -> list[Event]:
        for marker in END_MARKERS:
            text = text.replace(marker, "")
        events = self.reasoning.feed(text) if self.reasoning else [Content(text)]
        return self._after_reasoning(events)

    def finish(self, finish_type: str | None) -> list[Event]:
        events = self.reasoning.finish(finish_type) if self.reasoning else []
        out = self._after_reasoning(events)
        if self.tools:
            out += self._tidy(self.tools.finish(finish_type))
        self.pending_space = ""
        return merge_events(out)

    def _after_reasoning(self, events: list[Event]) -> list[Event]:
        out: list[Event] = []
        for event in events:
            if isinstance(event, Content) and self.tools:
                out += self._tidy(self.tools.feed(event.text))
            else:
                out += self._tidy([event])
        return merge_events(out)

    def _tidy(self, events: list[Event]) -> list[Event]:
        """Strip the content: leading space dropped, trailing space held until text follows."""
        out: list[Event] = []
        for event in events:
            if isinstance(event, ToolCallStart):
                self.num_calls += 1
            if not isinstance(event, Content):
                out.append(event)
                continue
            text = event.text if self.content_started else event.text.lstrip()
            if not text:
                continue
            self.content_started = True
            joined = self.pending_space + text
            visible = joined.rstrip()
            self.pending_space = joined[len(visible) :]
            if visible:
                out.append(Content(visible))
        return out


def collect(events: list[Event]) -> ParsedMessage:
    """Fold events into the message they describe."""
    msg = ParsedMessage()
    for event in events:
        if isinstance(event, Reasoning):
            msg.reasoning = (msg.reasoning or "") + event.text
        elif isinstance(event, Content):
            msg.content = (msg.content or "") + event.text
        elif isinstance(event, ToolCallStart):
            msg.tool_calls.append(ParsedCall(event.id, event.name))
        elif isinstance(event, ToolCallArgs):
            msg.tool_calls[event.index].arguments += event.fragment
    return msg
