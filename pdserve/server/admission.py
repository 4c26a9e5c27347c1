"""What every HTTP request passes before a route sees it: the API key, the
body-size limit, the body deadline and the drain gate of a graceful shutdown (pure
ASGI: streamed bodies are counted too, and no route has to remember any of these rules).

Contract
--------
* With an API key set, `/v1/*`, `/debug/*`, `/cluster/*` and the API docs (`/docs`, `/redoc`,
  `/openapi.json`) need `Authorization: Bearer KEY` (compared in constant time),
  else 401. `/health`, `/version`, `/metrics` are open.
* A body over `max_body_bytes` is refused with 413: at once when `Content-Length`
  says so, else the moment the streamed bytes pass the limit.
* A `/v1/*` body sent with `Content-Encoding: gzip` or `deflate` is decoded as it
  arrives and the limit holds for the decoded bytes too (`server/coding.py`: a gzip
  bomb is 413 without being inflated whole; a body that is not valid data of its
  coding is 400); the route sees the plain body. Any other coding is 415.
* A `/v1/*` request's body is read whole before the route runs; if it has not
  arrived within `body_timeout_s` the client gets 408 and the connection is closed.
  (Headers have their own deadline in `server/http.py`.)
* While `Admission.draining` is set, `/v1/*` requests get 503 (and `/health`
  says so), including those whose body was still arriving; the requests already
  inside finish. `inflight` counts `/v1/*` requests from the moment their body has
  arrived until their response (stream included) has been sent: a client that sends
  half a body cannot hold up a shutdown.
"""

from __future__ import annotations

import asyncio
import hmac

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pdserve.server.coding import BodyDecoder, CodingError, decoder_for
from pdserve.server.errors import reply

_GATED_PREFIX = "/v1/"
# An oversized body is read and dropped (up to this much) before the 413 goes out:
# clients that send the whole body before reading (urllib, httpx) would otherwise
# see the connection reset instead of the answer.
_DISCARD_CAP = 64 * 1024 * 1024
_KEYED_PREFIXES = (
    "/v1/",
    "/debug/",
    "/cluster/",
    "/admin/",
    "/docs",
    "/redoc",
    "/openapi.json",
)
_DRAINING = "the server is shutting down; no new requests are accepted"


class BodyTooLargeError(HTTPException):
    def __init__(self, limit: int) -> None:
        super().__init__(413, f"request body is larger than the limit of {limit} bytes")


class Admission:
    """Shared by the gate, the routes (/health) and the shutdown sequence."""

    def __init__(
        self, max_body_bytes: int, api_key: str | None = None, body_timeout_s: float = 30.0
    ) -> None:
        self.max_body_bytes = max_body_bytes
        self.api_key = None if api_key is None else api_key.encode()
        self.body_timeout_s = body_timeout_s
        self.draining = False
        self.inflight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._drain_started = asyncio.Event()

    def authorized(self, scope: Scope) -> bool:
        if self.api_key is None or not scope["path"].startswith(_KEYED_PREFIXES):
            return True
        header = _header(scope, b"authorization") or b""
        given = header[7:].strip() if header.startswith(b"Bearer ") else b""
        return hmac.compare_digest(given, self.api_key)

    def start_draining(self) -> None:
        """Refuse new requests from now on; wake the requests still reading a body.
        Call on the event loop (a signal handler only sets `draining`)."""
        self.draining = True
        self._drain_started.set()

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

    async def read_body(
        self, receive: Receive, decoder: BodyDecoder | None = None
    ) -> bytes | tuple[int, str] | None:
        """The whole body (decoded by `decoder` if given); or (status, message) to refuse
        it with; or None if the client went away. Gives up at the body deadline and when
        a drain starts. A refused body's rest is read and dropped."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.body_timeout_s
        chunks: list[bytes] = []
        seen = 0
        while True:
            message = await self._next_message(receive, deadline - loop.time())
            if isinstance(message, tuple):
                return message
            if message["type"] != "http.request":
                return None
            chunk = message.get("body", b"")
            seen += len(chunk)
            more = message.get("more_body", False)
            taken = self._take(chunk, seen, more, decoder)
            if isinstance(taken, tuple):
                if more:
                    await _discard_body(receive, seen)
                return taken
            chunks.append(taken)
            if not more:
                return b"".join(chunks)

    def _take(
        self, chunk: bytes, seen: int, more: bool, decoder: BodyDecoder | None
    ) -> bytes | tuple[int, str]:
        """One chunk as the route will see it, or why the body is refused."""
        if seen > self.max_body_bytes:
            return 413, BodyTooLargeError(self.max_body_bytes).detail
        if decoder is None:
            return chunk
        try:
            chunk = decoder.feed(chunk)
            if not more:
                decoder.end()
        except CodingError as e:
            return e.status, e.message
        return chunk

    async def _next_message(self, receive: Receive, timeout: float) -> Message | tuple[int, str]:
        if self.draining:
            return 503, _DRAINING
        receiving = asyncio.ensure_future(receive())
        draining = asyncio.ensure_future(self._drain_started.wait())
        try:
            done, _ = await asyncio.wait(
                {receiving, draining}, timeout=max(0.0, timeout), return_when="FIRST_COMPLETED"
            )
        finally:
            for task in (receiving, draining):
                task.cancel()
        if receiving in done:
            return receiving.result()
        if draining in done:
            return 503, _DRAINING
        return 408, (
            f"the request body did not arrive within the body timeout of {self.body_timeout_s:g} s"
        )


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
            await reply(send, 401, "invalid or missing API key (send 'Authorization: Bearer KEY')")
            return
        gated = scope["path"].startswith(_GATED_PREFIX)
        if gated and adm.draining:
            await reply(send, 503, _DRAINING)
            return
        declared = _content_length(scope)
        if declared is not None and declared > adm.max_body_bytes:
            limit = BodyTooLargeError(adm.max_body_bytes)
            await _discard_body(receive, 0)
            await reply(send, 413, f"{limit.detail} (Content-Length: {declared})")
            return
        if not gated:
            await self.app(scope, _limited(receive, adm.max_body_bytes), send)
            return
        await self._admit(scope, receive, send)

    async def _admit(self, scope: Scope, receive: Receive, send: Send) -> None:
        """A `/v1/*` request: its body first, then (unless draining) the route."""
        adm = self.admission
        try:
            decoder = decoder_for(_header(scope, b"content-encoding"), adm.max_body_bytes)
        except CodingError as e:
            await _discard_body(receive, 0)
            await reply(send, e.status, e.message)
            return
        body = await adm.read_body(receive, decoder)
        if body is None:
            return  # the client went away
        if isinstance(body, tuple):
            status, message = body
            # 408 and 503 leave the body unread: the connection cannot be reused.
            await reply(send, status, message, close=status in (408, 503))
            return
        if adm.draining:  # it began while the body arrived
            await reply(send, 503, _DRAINING)
            return
        if decoder is not None:
            scope = _decoded(scope, len(body))
        adm.enter()
        try:
            await self.app(scope, _replay(body, receive), send)
        finally:
            adm.leave()


def _decoded(scope: Scope, length: int) -> Scope:
    """The request as the route sees it after decoding: a plain body of `length` bytes."""
    dropped = (b"content-encoding", b"content-length")
    headers = [(k, v) for k, v in scope["headers"] if k not in dropped]
    return {**scope, "headers": [*headers, (b"content-length", str(length).encode())]}


def _replay(body: bytes, receive: Receive) -> Receive:
    """`receive` for a route: the body already read, then the client's later messages
    (`http.disconnect` when it goes away)."""
    pending = True

    async def wrapped() -> Message:
        nonlocal pending
        if pending:
            pending = False
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return wrapped


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
