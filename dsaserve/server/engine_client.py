"""The API process's side of the engine: send requests, route outputs, notice engine death.

Each submitted request gets a queue; outputs arrive on one ZMQ socket and are routed by rid. A
request stream that is closed (or dropped) before its request finished (client gone, handler
cancelled, an error between submit and the first read) unregisters its rid and sends an abort, so
the engine frees the request's KV at once and no rid stays "in flight". The engine's stats arrive
whenever they change and are kept in `stats`, so readers never wait for a step.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from dsaserve.cluster.frame_log import FrameLog
from dsaserve.engine.messages import GenerateRequest, RequestOutput
from dsaserve.runtime import ipc
from dsaserve.sampling_params import GRAMMAR_FIELDS
from dsaserve.web.errors import APIError

WATCH_INTERVAL_S = 0.2
logger = logging.getLogger("dsaserve.server")


class EngineDead(APIError):
    def __init__(self, message: str) -> None:
        super().__init__(503, f"engine unavailable: {message}", code="engine_dead")


class EngineClient:
    """Talks to one engine process over ZMQ; all methods run on the API event loop."""

    def __init__(self, paths: ipc.IpcPaths, secret: str | None = None) -> None:
        # Sending is synchronous and never blocks (NOBLOCK), so it is safe in `finally` blocks of
        # cancelled tasks; receiving is async. TCP sockets (DP attention across nodes) are CURVE
        # servers keyed by the cluster secret (`secret`); each context has its ZAP handler.
        self.send_context = zmq.Context()
        self.send_auth = ipc.auth_sockets(self.send_context, paths, secret)
        self.to_engine = ipc.serve_socket(self.send_auth, self.send_context.socket(zmq.PUSH))
        self.to_engine.bind(paths.to_engine)
        self.context = zmq.asyncio.Context()
        self.auth = ipc.auth_sockets(zmq.Context.shadow(self.context.underlying), paths, secret)
        self.from_engine = ipc.serve_socket(self.auth, self.context.socket(zmq.PULL))
        self.from_engine.bind(paths.from_engine)
        self.queues: dict[str, asyncio.Queue] = {}
        self.replies: dict[int, asyncio.Future] = {}
        self.control_ids = itertools.count()
        self.ready: asyncio.Future = asyncio.get_running_loop().create_future()
        self.dead: str | None = None
        self.process: multiprocessing.process.BaseProcess | None = None
        self.tasks: list[asyncio.Task] = []
        self.metrics: Any = None
        self.stats: dict = {}
        self.frames = FrameLog(logger, "the engine processes")

    def start(self, process: multiprocessing.process.BaseProcess) -> None:
        self.process = process
        self.tasks = [
            asyncio.create_task(self._receive_loop()),
            asyncio.create_task(self._watch_loop()),
        ]

    async def wait_ready(self) -> dict:
        return await self.ready

    async def submit(self, requests: list[GenerateRequest]) -> list[RequestStream]:
        """Send requests (admitted together or rejected together); one output stream each."""
        self._check_alive()
        rids = [r.rid for r in requests]
        if len(set(rids)) < len(rids) or any(rid in self.queues for rid in rids):
            raise APIError(400, "a request with this rid is already in flight", param="rid")
        try:
            data = ipc.encode(ipc.Submit(requests))
        except (OverflowError, TypeError, ValueError) as e:  # values the IPC cannot carry
            raise APIError(400, f"the request cannot be sent to the engine: {e}"[:200]) from e
        streams = [self._register(r.rid, _structured(r)) for r in requests]
        try:
            self._send_bytes(data)
        except BaseException:
            for stream in streams:
                stream.end(abort=False)
                if self.metrics is not None:
                    self.metrics.forget(stream.rid)
            raise
        return streams

    def _register(self, rid: str, structured: bool = False) -> RequestStream:
        self.queues[rid] = asyncio.Queue()
        if self.metrics is not None:
            self.metrics.on_submit(rid, structured)
        return RequestStream(self, rid, self.queues[rid])

    def forget(self, rid: str, queue: asyncio.Queue) -> None:
        if self.queues.get(rid) is queue:
            del self.queues[rid]

    def in_flight_rids(self, prefix: str = "") -> list[str]:
        return [rid for rid in self.queues if rid.startswith(prefix)]

    def abort(self, rids: list[str], by_client: bool = False) -> None:
        """Abort these requests in the engine; `by_client`: the client gave up on them (the
        metrics count those apart)."""
        if by_client and self.metrics is not None:
            self.metrics.on_client_cancel(rids)
        if self.dead is None and rids:
            self._send_abort(rids)

    def _send_abort(self, rids: list[str]) -> None:
        try:
            self._send(ipc.Abort(rids))
        except (APIError, zmq.ZMQError):
            pass  # the engine (or this client) is gone; nothing left to free

    def _send(self, message: ipc.ToEngine) -> None:
        self._send_bytes(ipc.encode(message))

    def _send_bytes(self, data: bytes) -> None:
        try:
            self.to_engine.send(data, zmq.NOBLOCK)
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
        for auth in (self.auth, self.send_auth):
            if auth is not None:
                auth.close()
        self.context.term()
        self.send_context.term()

    def _check_alive(self) -> None:
        if self.dead is not None:
            raise EngineDead(self.dead)

    async def _receive_loop(self) -> None:
        """Route every message; one that does not decode or cannot be routed is dropped (and
        logged sparingly), so no frame stops the outputs of every other request."""
        while True:
            data = await self.from_engine.recv()
            try:
                self._dispatch(ipc.decode_from_engine(data))
            except (msgspec.DecodeError, msgspec.ValidationError) as e:
                self.frames.dropped("undecodable", str(e))
            except Exception as e:
                self.frames.dropped("unroutable", f"{type(e).__name__}: {e}", exc_info=True)

    def _dispatch(self, message: ipc.FromEngine) -> None:
        if isinstance(message, ipc.Outputs):
            for output in message.outputs:
                if self.metrics is not None:
                    self.metrics.on_output(output)
                if output.rid in self.queues:
                    self.queues[output.rid].put_nowait(_error_or(output))
        elif isinstance(message, ipc.Stats):
            self.stats = message.stats
        elif isinstance(message, ipc.Rejected):
            for rid in message.rids:
                if self.metrics is not None:
                    self.metrics.forget(rid)
                if rid in self.queues:
                    retry = 1 if message.status == 429 else None
                    error = APIError(
                        message.status,
                        message.message,
                        retry_after=retry,
                        code="engine_refused" if message.status != 429 else None,
                    )
                    self.queues[rid].put_nowait(error)
        elif isinstance(message, ipc.ControlReply):
            future = self.replies.get(message.id)
            if future is not None and not future.done():
                future.set_result(message.result)
        elif isinstance(message, ipc.Ready):
            self.stats = dict(message.info.get("stats") or {})
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


def _structured(request: GenerateRequest) -> bool:
    """Whether a grammar constrains this request (SGLang's `num_so_requests` counts those)."""
    return any(request.sampling.get(name) is not None for name in GRAMMAR_FIELDS)


def _error_or(output: RequestOutput) -> RequestOutput | APIError:
    """An `error` finish (the engine failed on this request alone) becomes its APIError, and so
    does a refusal after admission (`error`: a grammar that failed to compile, a 400)."""
    if output.error is not None:
        return APIError(400, output.error, param=_param(output.error))
    reason = output.finish_reason or {}
    if output.finished and reason.get("type") == "error":
        status = int(reason.get("status") or 500)
        return APIError(status, str(reason.get("message") or "engine error"), code="engine_error")
    return output


class RequestStream:
    """The outputs of one engine request. Ending it early (aclose, or being dropped unread)
    unregisters the rid and aborts the request; finishing or failing unregisters it."""

    def __init__(self, client: EngineClient, rid: str, queue: asyncio.Queue) -> None:
        self.client = client
        self.rid = rid
        self.queue = queue
        self.done = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.done:
            raise StopAsyncIteration
        item = await self.queue.get()
        if isinstance(item, Exception):
            self.end(abort=False)
            raise item
        if item.finished:
            self.end(abort=False)
        return item

    def end(self, abort: bool, by_client: bool = True) -> None:
        """Unregister; with `abort`, abort the request too. An early end is the client's (a
        disconnect) unless the server ends it for its own reason (`by_client=False`)."""
        if self.done:
            return
        self.done = True
        self.client.forget(self.rid, self.queue)
        if abort:
            self.client.abort([self.rid], by_client)

    async def aclose(self) -> None:
        self.end(abort=True)

    def __del__(self) -> None:
        self.end(abort=True)


def _param(error: str) -> str | None:
    """The request field an engine-side refusal names ("json_schema: ..." -> json_schema)."""
    head = error.split(":", 1)[0]
    return head if head.isidentifier() else None
