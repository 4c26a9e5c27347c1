"""One error body for every failure: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

import json

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from pdserve.errors import (
    EngineDeadError,
    EngineOverloadedError,
    InstanceFailedError,
    InvalidRequestError,
    RequestCancelledError,
)

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    500: "internal_server_error",
    503: "service_unavailable_error",
}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


def error_body(status: int, message: str, param: str | None = None) -> dict[str, object]:
    kind = _TYPES.get(status, "invalid_request_error" if status < 500 else "internal_server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param), status_code=status)


async def on_api_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    return error_response(exc.status, exc.message, exc.param)


async def on_http_error(_: Request, exc: Exception) -> JSONResponse:
    """Starlette's own refusals (unknown route 404, wrong method 405, 413) in our shape."""
    assert isinstance(exc, HTTPException)
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
    return 500, "internal server error"


async def on_engine_error(_: Request, exc: Exception) -> JSONResponse:
    return error_response(*status_of(exc))


async def on_validation_error(_: Request, exc: Exception) -> JSONResponse:
    """pydantic's first complaint, as `field: problem` (no internals, no paths)."""
    assert isinstance(exc, RequestValidationError)
    first = exc.errors()[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body" and not _is_type_tag(str(p))]
    if first.get("type") == "json_invalid" or _unparsable(first.get("input")):
        return error_response(400, "request body is not valid JSON")
    if not loc:
        return error_response(400, "request body must be a JSON object")
    param = ".".join(loc)
    if first.get("type") == "extra_forbidden":
        return error_response(400, f"unknown field {param!r}", param)
    return error_response(400, f"{param}: {first.get('msg', 'invalid value')}", param)


async def on_unexpected(_: Request, exc: Exception) -> JSONResponse:
    return error_response(500, "internal server error")


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
