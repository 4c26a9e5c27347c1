"""What every HTTP request passes before a route sees it: the body-size limit and
the drain gate of a graceful shutdown (pure ASGI, so streamed bodies are counted
too and no route code has to remember either rule).

Contract
--------
* A body over `max_body_bytes` is refused with 413: at once when `Content-Length`
  says so, else the moment the streamed bytes pass the limit (`BodyTooLargeError`,
  an HTTPException, is raised from `receive`; the app's handler answers 413).
* While `Admission.draining` is set, `/v1/*` requests get 503 (and `/health`
  says so); the requests already inside finish. `inflight` counts `/v1/*`
  requests from entry until their response (stream included) has been sent.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pdserve.server.errors import error_body

_GATED_PREFIX = "/v1/"


class BodyTooLargeError(HTTPException):
    def __init__(self, limit: int) -> None:
        super().__init__(413, f"request body is larger than the limit of {limit} bytes")


class Admission:
    """Shared by the gate, the routes (/health) and the shutdown sequence."""

    def __init__(self, max_body_bytes: int) -> None:
        self.max_body_bytes = max_body_bytes
        self.draining = False
        self.inflight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    async def wait_idle(self, timeout: float) -> bool:
        """True once no `/v1/*` request is inside; False if `timeout` passed first."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except TimeoutError:
            return False
        return True

    def enter(self) -> None:
        self.inflight += 1
        self._idle.clear()

    def leave(self) -> None:
        self.inflight -= 1
        if self.inflight == 0:
            self._idle.set()


class AdmissionGate:
    """ASGI middleware applying `Admission`'s rules."""

    def __init__(self, app: ASGIApp, admission: Admission) -> None:
        self.app = app
        self.admission = admission

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        adm = self.admission
        gated = scope["path"].startswith(_GATED_PREFIX)
        if gated and adm.draining:
            await _reply(send, 503, "the server is shutting down; no new requests are accepted")
            return
        declared = _content_length(scope)
        if declared is not None and declared > adm.max_body_bytes:
            limit = BodyTooLargeError(adm.max_body_bytes)
            await _reply(send, 413, f"{limit.detail} (Content-Length: {declared})")
            return
        receive = _limited(receive, adm.max_body_bytes)
        if not gated:
            await self.app(scope, receive, send)
            return
        adm.enter()
        try:
            await self.app(scope, receive, send)
        finally:
            adm.leave()


def _limited(receive: Receive, limit: int) -> Receive:
    seen = 0

    async def wrapped() -> Message:
        nonlocal seen
        message = await receive()
        if message["type"] == "http.request":
            seen += len(message.get("body", b""))
            if seen > limit:
                raise BodyTooLargeError(limit)
        return message

    return wrapped


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


async def _reply(send: Send, status: int, message: str) -> None:
    body = json.dumps(error_body(status, message)).encode()
    headers: list[Any] = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
    ]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
