"""uvicorn's h11 protocol with a request-header deadline.

uvicorn times out idle keep-alive connections but not a client that sends half a request line or
half its headers (or nothing at all after connecting): such a connection is held forever. Here
every connection must complete its request headers within `--header-timeout` seconds of
connecting (or of the previous response); otherwise it is closed. Header size is bounded by h11's
`max_incomplete_event_size` (uvicorn's `h11_max_incomplete_event_size`), which answers 400.
"""

from __future__ import annotations

import asyncio
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

MAX_HEADER_BYTES = 64 * 1024


def header_timeout_protocol(timeout: float) -> type[H11Protocol]:
    """An `H11Protocol` class (for `uvicorn.Config(http=...)`) with this header deadline."""
    return type("HeaderTimeoutH11Protocol", (_HeaderTimeoutProtocol,), {"header_timeout": timeout})


class _HeaderTimeoutProtocol(H11Protocol):
    header_timeout = 10.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._header_deadline: asyncio.TimerHandle | None = None
        self._arm_header_deadline()

    def _arm_header_deadline(self) -> None:
        self._disarm_header_deadline()
        self._header_deadline = self.loop.call_later(self.header_timeout, self._headers_late)

    def _disarm_header_deadline(self) -> None:
        deadline = getattr(self, "_header_deadline", None)
        if deadline is not None:
            deadline.cancel()
            self._header_deadline = None

    def handle_events(self) -> None:
        super().handle_events()
        if self.conn.their_state is not h11.IDLE:  # the request's headers are in
            self._disarm_header_deadline()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm_header_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_deadline()
        super().connection_lost(exc)

    def _headers_late(self) -> None:
        self._header_deadline = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()


def uvicorn_limits(header_timeout: float) -> dict[str, Any]:
    """The uvicorn.Config keyword arguments for these limits."""
    return {
        "http": header_timeout_protocol(header_timeout),
        "h11_max_incomplete_event_size": MAX_HEADER_BYTES,
    }
