"""uvicorn's h11 protocol with request deadlines and an optional connection cap.

uvicorn times out idle keep-alive connections but not a client that sends half a request line or
half its headers (or nothing at all after connecting), nor one that declares a longer body than it
sends: such a connection is held forever. Here every connection must complete its request headers
within `--header-timeout` seconds of connecting (or of the previous response), and while a body is
arriving no `--header-timeout` may pass without a byte of it (time the server itself holds the
body back, under flow control, does not count); otherwise the connection is closed. Header size is
bounded by h11's `max_incomplete_event_size` (uvicorn's `h11_max_incomplete_event_size`), which
answers 400. With `max_connections`, a connection over the cap is answered 503 and closed at once.
"""

from __future__ import annotations

import asyncio
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

MAX_HEADER_BYTES = 64 * 1024
_BUSY = b"too many open connections"
OVER_CAPACITY = b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: text/plain\r\n" + (
    b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(_BUSY), _BUSY)
)


def header_timeout_protocol(
    timeout: float, max_connections: int | None = None
) -> type[H11Protocol]:
    """An `H11Protocol` class (for `uvicorn.Config(http=...)`) with these limits."""
    limits = {"header_timeout": timeout, "max_connections": max_connections}
    return type("HeaderTimeoutH11Protocol", (_HeaderTimeoutProtocol,), limits)


class _HeaderTimeoutProtocol(H11Protocol):
    header_timeout = 10.0
    max_connections: int | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._deadline: asyncio.TimerHandle | None = None
        if self.max_connections is not None and len(self.connections) > self.max_connections:
            transport.write(OVER_CAPACITY)
            transport.close()
            return
        self._arm_deadline()

    def _arm_deadline(self) -> None:
        self._disarm_deadline()
        self._deadline = self.loop.call_later(self.header_timeout, self._late)

    def _disarm_deadline(self) -> None:
        deadline = getattr(self, "_deadline", None)
        if deadline is not None:
            deadline.cancel()
            self._deadline = None

    def handle_events(self) -> None:
        super().handle_events()
        if self.conn.their_state is h11.SEND_BODY:  # a byte of the body came: the clock restarts
            self._arm_deadline()
        elif self.conn.their_state is not h11.IDLE:  # the whole request is in
            self._disarm_deadline()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_deadline()
        super().connection_lost(exc)

    def _late(self) -> None:
        self._deadline = None
        state = self.conn.their_state
        if self.transport.is_closing() or state not in (h11.IDLE, h11.SEND_BODY):
            return
        if state is h11.SEND_BODY and self.flow.read_paused:  # we are not reading: not its fault
            return self._arm_deadline()
        self.transport.close()


def uvicorn_limits(header_timeout: float, max_connections: int | None = None) -> dict[str, Any]:
    """The uvicorn.Config keyword arguments for these limits."""
    return {
        "http": header_timeout_protocol(header_timeout, max_connections),
        "h11_max_incomplete_event_size": MAX_HEADER_BYTES,
    }
