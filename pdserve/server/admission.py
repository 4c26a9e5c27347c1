"""What every HTTP request passes before a route sees it: the API key, the
body-size limit and the drain gate of a graceful shutdown (pure ASGI: streamed
bodies are counted too, and no route has to remember any of these rules).

Contract
--------
* With an API key set, `/v1/*` and `/debug/*` need `Authorization: Bearer KEY`
  (compared in constant time), else 401. `/health`, `/version`, `/metrics` are open.
* A body over `max_body_bytes` is refused with 413: at once when `Content-Length`
  says so, else the moment the streamed bytes pass the limit (`BodyTooLargeError`,
  an HTTPException, is raised from `receive`; the app's handler answers 413).
* While `Admission.draining` is set, `/v1/*` requests get 503 (and `/health`
  says so); the requests already inside finish. `inflight` counts `/v1/*`
  requests from entry until their response (stream included) has been sent.
"""

from __future__ import annotations

import asyncio
import hmac
import json
from typing import Any

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pdserve.server.errors import error_body

_GATED_PREFIX = "/v1/"
# An oversized body is read and dropped (up to this much) before the 413 goes out:
# clients that send the whole body before reading (urllib, httpx) would otherwise
# see the connection reset instead of the answer.
_DISCARD_CAP = 64 * 1024 * 1024
_KEYED_PREFIXES = ("/v1/", "/debug/")


class BodyTooLargeError(HTTPException):
    def __init__(self, limit: int) -> None:
        super().__init__(413, f"request body is larger than the limit of {limit} bytes")


class Admission:
    """Shared by the gate, the routes (/health) and the shutdown sequence."""

    def __init__(self, max_body_bytes: int, api_key: str | None = None) -> None:
        self.max_body_bytes = max_body_bytes
        self.api_key = None if api_key is None else api_key.encode()
        self.draining = False
        self.inflight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def authorized(self, scope: Scope) -> bool:
        if self.api_key is None or not scope["path"].startswith(_KEYED_PREFIXES):
            return True
        header = _header(scope, b"authorization") or b""
        given = header[7:].strip() if header.startswith(b"Bearer ") else b""
        return hmac.compare_digest(given, self.api_key)

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
        if not adm.authorized(scope):
            await _reply(send, 401, "invalid or missing API key (send 'Authorization: Bearer KEY')")
            return
        gated = scope["path"].startswith(_GATED_PREFIX)
        if gated and adm.draining:
            await _reply(send, 503, "the server is shutting down; no new requests are accepted")
            return
        declared = _content_length(scope)
        if declared is not None and declared > adm.max_body_bytes:
            limit = BodyTooLargeError(adm.max_body_bytes)
            await _discard_body(receive, 0)
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
                if message.get("more_body", False):
                    await _discard_body(receive, seen)
                raise BodyTooLargeError(limit)
        return message

    return wrapped


async def _discard_body(receive: Receive, seen: int) -> None:
    """Read the rest of a request body (up to `_DISCARD_CAP` in all) and drop it."""
    while seen <= _DISCARD_CAP:
        message = await receive()
        if message["type"] != "http.request":
            return  # the client went away
        seen += len(message.get("body", b""))
        if not message.get("more_body", False):
            return


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            return bytes(value)
    return None


def _content_length(scope: Scope) -> int | None:
    value = _header(scope, b"content-length")
    try:
        return None if value is None else int(value)
    except ValueError:
        return None


async def _reply(send: Send, status: int, message: str) -> None:
    body = json.dumps(error_body(status, message)).encode()
    headers: list[Any] = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
    ]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
