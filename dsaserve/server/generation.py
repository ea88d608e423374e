"""Running prepared requests: await first outputs, fan in the choices, parse each choice, abort
on client disconnect. Shared by the OpenAI, Anthropic and native routes."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Request

from dsaserve.engine.messages import RequestOutput
from dsaserve.server.engine_client import RequestStream
from dsaserve.server.parsers.chat_output import ChatOutputParser
from dsaserve.server.parsers.choice import REASONING_PARSERS, TOOL_PARSERS
from dsaserve.server.parsers.events import Event, ToolCallArgs, ToolCallStart
from dsaserve.server.parsers.reasoning import Glm45ReasoningParser
from dsaserve.server.tokenizer_manager import PreparedChat
from dsaserve.web.errors import APIError

T = TypeVar("T")
DISCONNECT_POLL_S = 0.1


async def first_outputs(streams: list[RequestStream]) -> list[tuple[RequestOutput, RequestStream]]:
    """Wait for each stream's first output (so admission errors can still set the HTTP status)."""
    tasks = [asyncio.ensure_future(anext(s)) for s in streams]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        failed = [t for t in done if t.exception() is not None]
        if failed:
            raise failed[0].exception()
    except BaseException as e:  # a sibling refused (the server's), or the client went away
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for stream in streams:
            stream.end(abort=True, by_client=isinstance(e, asyncio.CancelledError))
        raise
    return [(t.result(), s) for t, s in zip(tasks, streams)]


async def fan_in(
    primed: list[tuple[RequestOutput, RequestStream]],
) -> AsyncIterator[tuple[int, Any]]:
    """Yield (choice index, output) from all choices as they arrive; closing aborts the rest
    (the client's abort, unless a choice failed)."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, first: RequestOutput, stream: RequestStream) -> None:
        try:
            await queue.put((index, first))
            async for output in stream:
                await queue.put((index, output))
        except Exception as e:
            await queue.put((index, e))

    tasks = [asyncio.create_task(pump(i, f, s)) for i, (f, s) in enumerate(primed)]
    remaining = {i for i, (f, _) in enumerate(primed)}
    failed = False
    try:
        while remaining:
            index, item = await queue.get()
            if isinstance(item, Exception):
                failed = True
                raise item
            if item.finished:
                remaining.discard(index)
            yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for _, stream in primed:
            stream.end(abort=True, by_client=not failed)


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Run `work`; if the client goes away first, cancel it (which aborts its requests)."""
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        while not await request.is_disconnected():
            await asyncio.sleep(DISCONNECT_POLL_S)

    watcher = asyncio.create_task(watch())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        raise APIError(499, "client disconnected")
    return task.result()


@dataclass
class ChatChoice:
    """One choice of a chat request: its parser state and counters."""

    parser: ChatOutputParser
    drop_tool_calls: bool
    completion_tokens: int = 0
    reasoning_tokens: int = 0
    num_calls: int = 0
    finish_reason: str | None = None
    matched: Any = None
    logprobs: list = field(default_factory=list)
    events: list[Event] = field(default_factory=list)

    @classmethod
    def create(cls, prepared: PreparedChat, separate_reasoning: bool) -> ChatChoice:
        reasoning = None
        if separate_reasoning and prepared.reasoning_parser:
            reasoning = REASONING_PARSERS[prepared.reasoning_parser](prepared.force_reasoning)
        tools = None
        if prepared.tool_parser and prepared.tools:
            tools = TOOL_PARSERS[prepared.tool_parser](_parser_tools(prepared))
        parser = ChatOutputParser(reasoning, tools)
        return cls(parser, drop_tool_calls=prepared.tool_choice == "none")

    def update(self, output: RequestOutput) -> list[Event]:
        in_reasoning = self._in_reasoning()
        events = self.parser.feed(output.text)
        if in_reasoning and self._in_reasoning():
            self.reasoning_tokens += len(output.token_ids)
        self.completion_tokens = max(self.completion_tokens, output.completion_tokens)
        if output.logprobs:
            self.logprobs.extend(output.logprobs)
        if output.finished:
            reason = output.finish_reason or {"type": "stop"}
            events += self.parser.finish(reason.get("type"))
            self.matched = reason.get("matched")
            self.finish_reason = reason.get("type", "stop")
        if self.drop_tool_calls:
            events = [e for e in events if not isinstance(e, ToolCallStart | ToolCallArgs)]
        self.num_calls += sum(isinstance(e, ToolCallStart) for e in events)
        if self.finish_reason == "stop" and self.num_calls:
            self.finish_reason = "tool_calls"
        self.events += events
        return events

    def _in_reasoning(self) -> bool:
        reasoning = self.parser.reasoning
        return isinstance(reasoning, Glm45ReasoningParser) and reasoning.state in (
            "leading",
            "reasoning",
        )


def _parser_tools(prepared: PreparedChat) -> list[dict]:
    choice = prepared.tool_choice
    if isinstance(choice, dict) and choice.get("function"):
        name = choice["function"].get("name")
        return [t for t in prepared.tools if t["function"]["name"] == name]
    return prepared.tools
