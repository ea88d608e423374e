"""Reading and decoding request bodies without stalling the event loop.

JSON decoding and pydantic validation hold the GIL, so a thread does not keep `/health` fast while
a 30 MB body is decoded (that takes ~0.4 s of C code). Small bodies are decoded inline (well under
a millisecond), medium ones in a thread, and large ones in a worker process, which sends back
either the validated model or the error. A large body with a Content-Length is written chunk by
chunk into shared memory as it arrives, so the API process never copies (or pickles) it whole:
one 30 MB copy holds the GIL for tens of milliseconds. A worker that dies (a body that exhausts
its memory) is replaced, and its request gets a 413.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from multiprocessing import shared_memory
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel

from dsaserve.server.validation import INLINE_MAX_BYTES, decode_model, read_body
from dsaserve.web.errors import APIError

M = TypeVar("M", bound=BaseModel)
logger = logging.getLogger("dsaserve.server")
THREAD_MAX_BYTES = 1024 * 1024
WORKERS = 1


def decode_in_worker(body: bytes | str, model: type[M], context: dict | None, size: int = 0):
    """Worker-process side (`body`: the bytes, or the name of a shared-memory block of `size`
    bytes): ("ok", model) or ("error", status, message, param, code)."""
    if isinstance(body, str):
        block = shared_memory.SharedMemory(body)  # the API process unlinks it
        try:
            body = bytes(block.buf[:size])
        finally:
            block.close()
    try:
        return ("ok", decode_model(body, model, context))
    except APIError as e:
        return ("error", e.status, e.message, e.param, e.code)


class BodyDecoder:
    """Chooses where a body is decoded by its size; owns the worker process (started lazily)."""

    def __init__(self, use_processes: bool = True) -> None:
        self.use_processes = use_processes
        self.pool: ProcessPoolExecutor | None = None

    async def read_and_decode(
        self, request: Request, limit: int, model: type[M], context: dict | None = None
    ) -> M:
        """The request's body, read (413 over `limit`) and decoded where its size says."""
        declared = request.headers.get("content-length", "")
        size = int(declared) if declared.isdigit() else 0
        if not self.use_processes or size <= THREAD_MAX_BYTES or size > limit:
            return await self.decode(await read_body(request, limit), model, context)
        block = shared_memory.SharedMemory(create=True, size=size)
        try:
            received = 0
            async for chunk in request.stream():
                if received + len(chunk) > size:
                    raise APIError(400, "the body is longer than its Content-Length")
                block.buf[received : received + len(chunk)] = chunk
                received += len(chunk)
            return await self._in_process(block.name, model, context, received)
        finally:
            block.close()
            block.unlink()

    async def decode(self, body: bytes, model: type[M], context: dict | None = None) -> M:
        if len(body) <= INLINE_MAX_BYTES:
            return decode_model(body, model, context)
        if len(body) <= THREAD_MAX_BYTES or not self.use_processes:
            return await asyncio.to_thread(decode_model, body, model, context)
        return await self._in_process(body, model, context)

    async def _in_process(
        self, body: bytes | str, model: type[M], context: dict | None, size: int = 0
    ) -> M:
        loop = asyncio.get_running_loop()
        try:
            result = await loop.run_in_executor(
                self._pool(), decode_in_worker, body, model, context, size
            )
        except BrokenProcessPool as e:
            logger.warning("the body decoder process died; starting a new one")
            self.close()
            raise APIError(413, "request body too complex to decode") from e
        if result[0] == "error":
            _, status, message, param, code = result
            raise APIError(status, message, param=param, code=code)
        return result[1]

    def _pool(self) -> ProcessPoolExecutor:
        if self.pool is None:
            context = multiprocessing.get_context("spawn")
            self.pool = ProcessPoolExecutor(WORKERS, mp_context=context)
        return self.pool

    def start(self) -> None:
        """Start the worker now (it imports the models once), so the first big body is fast."""
        if self.use_processes:
            self._pool().submit(_warm_up)

    def close(self) -> None:
        pool, self.pool = self.pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)


def _warm_up() -> Any:
    import dsaserve.server.anthropic.protocol  # noqa: F401
    import dsaserve.server.openai.protocol  # noqa: F401

    return None
