"""uvicorn's h11 connection protocol with a deadline for request headers.

uvicorn bounds the idle time between requests on a keep-alive connection, but not the
time a client takes to send a request's headers: a connection that sends half a
request line and stops (slowloris) stays open for good. Here every connection that is
waiting for a request's headers — from the moment it opens, or from the first byte of
its next request — gets `header_timeout` seconds to complete them; then it receives 408
and is closed. (The body's deadline is the admission gate's: `server/admission.py`.)
"""

from __future__ import annotations

import asyncio
import json

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from pdserve.server.errors import error_body


class _HeaderDeadlineProtocol(H11Protocol):
    header_timeout = 10.0
    _header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._watch_headers()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._watch_headers()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        # The keep-alive timer covers the idle time until the next request's first byte.
        self._cancel_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)

    def _watch_headers(self) -> None:
        """Arm the deadline while a started request's headers are incomplete."""
        waiting = self.conn.their_state is h11.IDLE and not self.transport.is_closing()
        if waiting and self._header_timer is None and self._started_or_new():
            self._header_timer = self.loop.call_later(self.header_timeout, self._headers_late)
        elif not waiting:
            self._cancel_header_timer()

    def _started_or_new(self) -> bool:
        """A new connection, or bytes of the next request have arrived."""
        return self.timeout_keep_alive_task is None

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_late(self) -> None:
        self._header_timer = None
        if self.conn.their_state is not h11.IDLE or self.transport.is_closing():
            return
        message = f"the request headers did not arrive within {self.header_timeout:g} s"
        body = json.dumps(error_body(408, message)).encode()
        head = (
            "HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
            f"connection: close\r\ncontent-length: {len(body)}\r\n\r\n"
        ).encode()
        self.transport.write(head + body)
        self.transport.close()


def header_deadline_protocol(header_timeout: float) -> type[H11Protocol]:
    """The protocol class to give uvicorn (`uvicorn.Config(http=...)`)."""
    return type(
        "HeaderDeadlineProtocol", (_HeaderDeadlineProtocol,), {"header_timeout": header_timeout}
    )
