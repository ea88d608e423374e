"""The `glm45` reasoning parser: split GLM output into reasoning (`<think>…</think>`) and content.

Behaviour (serving-api.md §1, field reports B15–B20):
- `force_reasoning` (the rendered prompt ends with `<think>`): the output starts inside reasoning;
  repeated leading `<think>` tags are dropped.
- Otherwise the output is in reasoning only if it begins with `<think>`.
- Reasoning ends at the first `</think>` (dropped) or at a `<tool_call>` (kept for the tool parser).
- A generation that stops (not `length`) while still inside reasoning did not think: the model
  answered without `</think>`. Its text stays in `reasoning_content` as streamed, and is also
  emitted as `content` at the end, so the answer is never lost (sglang's
  `force_nonempty_content`, applied by default; field report B15).
"""

from __future__ import annotations

from dsaserve.server.parsers.events import Content, Event, Reasoning, find_first, held_suffix

THINK_START = "<think>"
THINK_END = "</think>"
TOOL_START = "<tool_call>"


class Glm45ReasoningParser:
    """Streaming reasoning splitter; feed text chunks, then call `finish(finish_type)`."""

    exits: tuple[str, ...] = (TOOL_START,)  # tags that end reasoning and stay in the content

    def __init__(self, force_reasoning: bool) -> None:
        self.state = "leading" if force_reasoning else "start"
        self.buffer = ""
        self.reasoning_text = ""

    def feed(self, text: str) -> list[Event]:
        self.buffer += text
        events: list[Event] = []
        while True:
            step = getattr(self, f"_step_{self.state}")(events)
            if not step:
                return events

    def finish(self, finish_type: str | None) -> list[Event]:
        events: list[Event] = []
        rest, self.buffer = self.buffer, ""
        if self.state in ("leading", "reasoning"):
            events.append(self._reason(rest))
            if finish_type not in ("length", "abort") and self.reasoning_text:
                events.append(Content(self.reasoning_text))
        else:
            events.append(Content(rest))
        self.state = "done"
        return events

    # Each step consumes what it can; it returns True when the state changed and should rerun.
    def _step_start(self, events: list[Event]) -> bool:
        if THINK_START.startswith(self.buffer):
            return False  # empty, or a prefix of <think>: wait
        if self.buffer.startswith(THINK_START):
            self.buffer = self.buffer[len(THINK_START) :]
            self.state = "leading"
        else:
            self.state = "content"
        return True

    def _step_leading(self, events: list[Event]) -> bool:
        if self.buffer.startswith(THINK_START):
            self.buffer = self.buffer[len(THINK_START) :]
            return True
        if THINK_START.startswith(self.buffer):
            return False  # empty, or a prefix of <think>: wait
        self.state = "reasoning"
        return True

    def _step_reasoning(self, events: list[Event]) -> bool:
        pos, tag = find_first(self.buffer, (THINK_END, *self.exits))
        if tag is None:
            keep = held_suffix(self.buffer, (THINK_END, *self.exits))
            emit = self.buffer[: len(self.buffer) - keep]
            self.buffer = self.buffer[len(emit) :]
            events.append(self._reason(emit))
            return False
        events.append(self._reason(self.buffer[:pos]))
        after = pos + len(tag) if tag == THINK_END else pos
        self.buffer = self.buffer[after:]
        self.state = "content"
        return True

    def _step_content(self, events: list[Event]) -> bool:
        events.append(Content(self.buffer))
        self.buffer = ""
        return False

    def _step_done(self, events: list[Event]) -> bool:
        return False

    def _reason(self, text: str) -> Reasoning:
        self.reasoning_text += text
        return Reasoning(text)
