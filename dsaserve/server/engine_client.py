"""The API process's side of the engine: send requests, route outputs, notice engine death.

Each submitted request gets a queue; outputs arrive on one ZMQ socket and are routed by rid. A
request stream that is closed before its request finished (client gone, handler cancelled) sends an
abort, so the engine frees the request's KV at once.
"""

from __future__ import annotations

import asyncio
import itertools
import multiprocessing
from collections.abc import AsyncIterator
from typing import Any

import zmq
import zmq.asyncio

from dsaserve.engine.io import GenerateRequest, RequestOutput
from dsaserve.server import ipc
from dsaserve.server.errors import APIError

WATCH_INTERVAL_S = 0.2


class EngineDead(APIError):
    def __init__(self, message: str) -> None:
        super().__init__(503, f"engine unavailable: {message}", code="engine_dead")


class EngineClient:
    """Talks to one engine process over ZMQ; all methods run on the API event loop."""

    def __init__(self, paths: ipc.IpcPaths) -> None:
        # Sending is synchronous and never blocks (NOBLOCK), so it is safe in `finally` blocks of
        # cancelled tasks; receiving is async.
        self.send_context = zmq.Context()
        self.to_engine = self.send_context.socket(zmq.PUSH)
        self.to_engine.bind(paths.to_engine)
        self.context = zmq.asyncio.Context()
        self.from_engine = self.context.socket(zmq.PULL)
        self.from_engine.bind(paths.from_engine)
        self.queues: dict[str, asyncio.Queue] = {}
        self.replies: dict[int, asyncio.Future] = {}
        self.control_ids = itertools.count()
        self.ready: asyncio.Future = asyncio.get_running_loop().create_future()
        self.dead: str | None = None
        self.process: multiprocessing.process.BaseProcess | None = None
        self.tasks: list[asyncio.Task] = []
        self.metrics: Any = None

    def start(self, process: multiprocessing.process.BaseProcess) -> None:
        self.process = process
        self.tasks = [
            asyncio.create_task(self._receive_loop()),
            asyncio.create_task(self._watch_loop()),
        ]

    async def wait_ready(self) -> dict:
        return await self.ready

    @property
    def num_in_flight(self) -> int:
        return len(self.queues)

    async def submit(self, requests: list[GenerateRequest]) -> list[AsyncIterator[RequestOutput]]:
        """Send requests (admitted together or rejected together); one output stream each."""
        self._check_alive()
        rids = [r.rid for r in requests]
        if len(set(rids)) < len(rids) or any(rid in self.queues for rid in rids):
            raise APIError(400, "a request with this rid is already in flight", param="rid")
        for request in requests:
            self.queues[request.rid] = asyncio.Queue()
            if self.metrics is not None:
                self.metrics.on_submit(request.rid)
        try:
            self._send(ipc.Submit(requests))
        except APIError:
            for request in requests:
                self.queues.pop(request.rid, None)
            raise
        return [self._stream(r.rid) for r in requests]

    async def _stream(self, rid: str) -> AsyncIterator[RequestOutput]:
        queue = self.queues[rid]
        finished = False
        try:
            while not finished:
                item = await queue.get()
                if isinstance(item, Exception):
                    finished = True
                    raise item
                finished = item.finished
                yield item
        finally:
            self.queues.pop(rid, None)
            if not finished:
                self.abort([rid])

    def in_flight_rids(self, prefix: str = "") -> list[str]:
        return [rid for rid in self.queues if rid.startswith(prefix)]

    def abort(self, rids: list[str]) -> None:
        if self.dead is None:
            try:
                self._send(ipc.Abort(rids))
            except APIError:
                pass  # the engine is gone; nothing left to free

    def _send(self, message: ipc.ToEngine) -> None:
        try:
            self.to_engine.send(ipc.encode(message), zmq.NOBLOCK)
        except zmq.Again as e:
            raise APIError(503, "engine is not accepting requests", retry_after=1) from e

    async def control(self, op: str, timeout: float = 30.0) -> Any:
        self._check_alive()
        call_id = next(self.control_ids)
        future = asyncio.get_running_loop().create_future()
        self.replies[call_id] = future
        self._send(ipc.Control(call_id, op))
        try:
            return await asyncio.wait_for(future, timeout)
        except TimeoutError as e:
            raise APIError(503, f"engine did not answer '{op}' within {timeout}s") from e
        finally:
            self.replies.pop(call_id, None)

    async def shutdown(self) -> None:
        if self.dead is None:
            try:
                self._send(ipc.Shutdown())
            except APIError:
                pass
        for task in self.tasks:
            task.cancel()

    def close(self) -> None:
        self.to_engine.close(linger=1000)
        self.from_engine.close(linger=0)
        self.context.term()
        self.send_context.term()

    def _check_alive(self) -> None:
        if self.dead is not None:
            raise EngineDead(self.dead)

    async def _receive_loop(self) -> None:
        while True:
            message = ipc.decode_from_engine(await self.from_engine.recv())
            self._dispatch(message)

    def _dispatch(self, message: ipc.FromEngine) -> None:
        if isinstance(message, ipc.Outputs):
            for output in message.outputs:
                if self.metrics is not None:
                    self.metrics.on_output(output)
                if output.rid in self.queues:
                    error = output.error  # refused after admission (a grammar that failed)
                    item = output if error is None else APIError(400, error, param=_param(error))
                    self.queues[output.rid].put_nowait(item)
        elif isinstance(message, ipc.Rejected):
            for rid in message.rids:
                if self.metrics is not None:
                    self.metrics.forget(rid)
                if rid in self.queues:
                    retry = 1 if message.status == 429 else None
                    error = APIError(message.status, message.message, retry_after=retry)
                    self.queues[rid].put_nowait(error)
        elif isinstance(message, ipc.ControlReply):
            future = self.replies.get(message.id)
            if future is not None and not future.done():
                future.set_result(message.result)
        elif isinstance(message, ipc.Ready):
            if not self.ready.done():
                self.ready.set_result(message.info)
        elif isinstance(message, ipc.Fatal):
            self._mark_dead(message.message)

    async def _watch_loop(self) -> None:
        while self.dead is None:
            await asyncio.sleep(WATCH_INTERVAL_S)
            if self.process is not None and not self.process.is_alive():
                self._mark_dead(f"engine process exited with code {self.process.exitcode}")

    def _mark_dead(self, reason: str) -> None:
        if self.dead is not None:
            return
        self.dead = reason
        error = EngineDead(reason)
        for queue in self.queues.values():
            queue.put_nowait(error)
        for future in self.replies.values():
            if not future.done():
                future.set_exception(error)
        if not self.ready.done():
            self.ready.set_exception(error)


def _param(error: str) -> str | None:
    """The request field an engine-side refusal names ("json_schema: ..." -> json_schema)."""
    head = error.split(":", 1)[0]
    return head if head.isidentifier() else None
