"""What the output parsers emit, and the tag hold-back helper they share.

A parser turns model text into a list of events. Streaming and non-streaming feed the same parser
objects (non-streaming is one big chunk), so the two modes cannot disagree.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass
class Reasoning:
    text: str


@dataclass
class Content:
    text: str


@dataclass
class ToolCallStart:
    """A tool call whose name is complete; `index` is the call order within the response."""

    index: int
    id: str
    name: str


@dataclass
class ToolCallArgs:
    """A fragment of the JSON text of a call's arguments."""

    index: int
    fragment: str


Event = Reasoning | Content | ToolCallStart | ToolCallArgs


def held_suffix(buffer: str, tags: tuple[str, ...]) -> int:
    """Length of the longest suffix of `buffer` that is a proper prefix of one of `tags`.

    That suffix must be held back: the next chunk may complete it into a tag.
    """
    longest = 0
    for tag in tags:
        for size in range(min(len(tag) - 1, len(buffer)), longest, -1):
            if buffer.endswith(tag[:size]):
                longest = size
                break
    return longest


def find_first(buffer: str, tags: tuple[str, ...]) -> tuple[int, str | None]:
    """The earliest occurrence of any tag: (position, tag), or (-1, None)."""
    best, found = -1, None
    for tag in tags:
        pos = buffer.find(tag)
        if pos != -1 and (best == -1 or pos < best):
            best, found = pos, tag
    return best, found


def merge_events(events: list[Event]) -> list[Event]:
    """Join consecutive text events of one kind (and argument fragments of one call)."""
    merged: list[Event] = []
    for event in events:
        last = merged[-1] if merged else None
        if isinstance(event, Reasoning | Content) and type(last) is type(event):
            last.text += event.text
        elif (
            isinstance(event, ToolCallArgs)
            and isinstance(last, ToolCallArgs)
            and (last.index == event.index)
        ):
            last.fragment += event.fragment
        elif isinstance(event, Reasoning | Content) and not event.text:
            continue
        else:
            merged.append(dataclasses.replace(event))
    return merged
