"""One error body for every failure: {"error": {"message", "type", "param", "code"}}.

Contract: every response that is not a success carries this body, whatever raised it
— a route, pydantic, Starlette's router, the admission gate (`reply`), or a bug
(`UnexpectedErrorGuard`: 500, logged with its traceback, connection kept usable). The
message and param are made printable first (a lone surrogate from a client's JSON would
fail the UTF-8 encoding of the body itself).
"""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pdserve.errors import (
    ConflictError,
    EngineDeadError,
    EngineOverloadedError,
    InstanceFailedError,
    InvalidRequestError,
    NotFoundError,
    RequestCancelledError,
)

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    500: "internal_server_error",
    503: "service_unavailable_error",
}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


_log = logging.getLogger("pdserve.server")
_FASTAPI_PARSE_ERROR = "There was an error parsing the body"
_UNPARSABLE = (
    "request body is not valid JSON (invalid UTF-8, nesting deeper than the parser's limit, "
    "or an integer of more than 4300 digits)"
)


def error_body(status: int, message: str, param: str | None = None) -> dict[str, object]:
    kind = _TYPES.get(status, "invalid_request_error" if status < 500 else "internal_server_error")
    param = None if param is None else _printable(param)
    return {"error": {"message": _printable(message), "type": kind, "param": param, "code": status}}


def _printable(text: str) -> str:
    """`text` with what UTF-8 cannot encode (lone surrogates) escaped as \\udXXX."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


async def reply(send: Send, status: int, message: str, close: bool = False) -> None:
    """Send a whole error response from ASGI code (middleware, before any route).
    `close`: ask the client to close the connection (the request was not read whole)."""
    body = json.dumps(error_body(status, message)).encode()
    headers: list[Any] = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
    ]
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class UnexpectedErrorGuard:
    """ASGI middleware: an exception no handler took becomes a logged 500 error body.

    Unlike Starlette's ServerErrorMiddleware it does not re-raise, so uvicorn keeps the
    keep-alive connection (it would otherwise close it under the client's next request).
    If the response had already started (a stream), nothing valid can be sent: the
    exception goes on and the server closes the connection, which the client sees as a
    cut stream.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracked(message: Message) -> None:
            nonlocal started
            started = True
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except Exception:
            if started:
                raise
            _log.exception("unexpected error in %s %s", scope["method"], scope["path"])
            await reply(send, 500, "internal server error")


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param), status_code=status)


async def on_api_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    return error_response(exc.status, exc.message, exc.param)


async def on_http_error(_: Request, exc: Exception) -> JSONResponse:
    """Starlette's own refusals (unknown route 404, wrong method 405, 413) in our shape."""
    assert isinstance(exc, HTTPException)
    if exc.detail == _FASTAPI_PARSE_ERROR:  # what json.loads refused, in our words
        return error_response(400, _UNPARSABLE)
    return error_response(exc.status_code, str(exc.detail))


async def on_invalid_request(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, InvalidRequestError)
    return error_response(400, exc.message, exc.param)


def status_of(exc: Exception) -> tuple[int, str]:
    """HTTP status and message for an engine-side failure of a request."""
    if isinstance(exc, EngineDeadError):
        return 500, f"the engine is not available: {exc}"
    if isinstance(exc, EngineOverloadedError | RequestCancelledError | InstanceFailedError):
        return 503, str(exc)
    if isinstance(exc, NotFoundError):
        return 404, str(exc)
    if isinstance(exc, ConflictError):
        return 409, str(exc)
    return 500, "internal server error"


async def on_engine_error(_: Request, exc: Exception) -> JSONResponse:
    return error_response(*status_of(exc))


_UNIONS = {
    "prompt": "a string, a list of strings, a list of token ids or a list of token-id lists",
    "stop": "a string or a list of strings",
}


async def on_validation_error(_: Request, exc: Exception) -> JSONResponse:
    """pydantic's first complaint, as `field: problem` (no internals, no paths)."""
    assert isinstance(exc, RequestValidationError)
    first = exc.errors()[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body" and not _is_type_tag(str(p))]
    if first.get("type") == "json_invalid" or _unparsable(first.get("input")):
        return error_response(400, "request body is not valid JSON")
    if first.get("type") == "string_unicode":  # pydantic's check of field names
        where = ".".join(loc) if loc else "a field name"
        message = f"{where} is not valid Unicode: it holds a lone surrogate"
        return error_response(400, message, ".".join(loc) or None)
    if not loc:
        return error_response(400, "request body must be a JSON object")
    param = ".".join(loc)
    tried_union = any(_is_type_tag(str(p)) for p in first.get("loc", ()))
    tried_union |= first.get("type") == "union_tag_not_found"  # the value fits no member
    if tried_union and loc[0] in _UNIONS:  # pydantic names only the member it tried first
        return error_response(400, f"{loc[0]} must be {_UNIONS[loc[0]]}", loc[0])
    if first.get("type") == "extra_forbidden":
        return error_response(400, f"unknown field {param!r}", param)
    return error_response(400, f"{param}: {first.get('msg', 'invalid value')}", param)


def _unparsable(raw: object) -> bool:
    """FastAPI hands over raw bytes when the content type is not JSON: parse them."""
    if not isinstance(raw, bytes):
        return False
    try:
        json.loads(raw)
    except ValueError:
        return True
    return False


def _is_type_tag(part: str) -> bool:
    """pydantic names the union member it tried (`prompt.str`): not part of the field."""
    return "[" in part or part in {"str", "int", "float", "bool", "none"}
