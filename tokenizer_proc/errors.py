"""OpenAI-style errors: one exception type and one body shape for every HTTP error.

Every error this process returns (400, 401, 404, 413, 500, 503) has the body
`{"error": {"message", "type", "param", "code"}}`, including FastAPI's own validation
errors and malformed JSON, so that OpenAI clients surface a readable message. Under
Anthropic's routes (/v1/messages) the same error has Anthropic's shape,
`{"type": "error", "error": {"type", "message"}}`, with the param named in the message.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

INVALID_REQUEST = "invalid_request_error"
SERVER_ERROR = "server_error"


SERVER_UNAVAILABLE = "server unavailable"
"""Prefix of errors that mean the server gave up restarting: answered 503, not 500."""


class APIError(Exception):
    """An error to return to the client as-is (status code plus OpenAI error body)."""

    def __init__(
        self,
        message: str,
        status_code: int = 400,
        *,
        param: str | None = None,
        code: str | None = None,
        type_: str = INVALID_REQUEST,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.param = param
        self.code = code
        self.type = type_
        self.headers = headers

    def in_words_of(self, renamed: Mapping[str, str]) -> APIError:
        """This error, its param named as another API names the field (`renamed`: ours -> theirs)."""
        self.param = renamed.get(self.param or "", self.param)
        return self


def error_body(message: str, type_: str = INVALID_REQUEST, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


ANTHROPIC_PREFIX = "/v1/messages"
"""Routes whose errors have Anthropic's shape."""

_ANTHROPIC_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}
"""Anthropic's error type by status: 400s are invalid_request_error, other 500s api_error."""


def anthropic_error_body(message: str, status_code: int) -> dict[str, Any]:
    kind = _ANTHROPIC_TYPES.get(status_code, "api_error" if status_code >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def error_response(
    message: str,
    status_code: int,
    *,
    type_: str = INVALID_REQUEST,
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
    path: str = "",
) -> JSONResponse:
    """`path`: the request's, which picks the body's shape (OpenAI's, or Anthropic's)."""
    if path.startswith(ANTHROPIC_PREFIX):
        named = f"{param}: {message}" if param and not message.startswith(param) else message
        return JSONResponse(anthropic_error_body(named, status_code), status_code=status_code, headers=headers)
    return JSONResponse(error_body(message, type_, param, code), status_code=status_code, headers=headers)


def api_error_response(err: APIError, path: str = "") -> JSONResponse:
    return error_response(
        err.message, err.status_code, type_=err.type, param=err.param, code=err.code, headers=err.headers, path=path
    )


def _loc_to_param(loc: tuple[Any, ...]) -> str | None:
    """The top-level field an error is about (pydantic adds union members and indices)."""
    parts = [str(p) for p in loc if p != "body"]
    return parts[0] if parts else None


def validation_error_message(errors: list[dict[str, Any]]) -> tuple[str, str | None, str | None]:
    """(message, param, code) for the first pydantic/FastAPI validation error."""
    if not errors:
        return "invalid request", None, None
    first = errors[0]
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "")
        return f"malformed JSON body: {detail}".rstrip(": "), None, "json_invalid"
    loc = tuple(first.get("loc", ()))
    param = _loc_to_param(loc)
    where = ".".join(str(p) for p in loc if p != "body")
    msg = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    message = f"{where}: {msg}" if where else msg
    if first.get("type") == "extra_forbidden":
        message, param = f"Unrecognized request argument supplied: {where}", where
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more error{'s' if len(errors) > 2 else ''})"
    return message, param, first.get("type")


def validation_api_error(errors: list[dict[str, Any]]) -> APIError:
    """A 400 for a body part validated inside a route (pydantic's errors, as FastAPI's are told)."""
    message, param, code = validation_error_message(errors)
    return APIError(message, param=param, code=code)


async def _api_error_handler(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    return api_error_response(exc, request.url.path)


async def _validation_handler(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    message, param, code = validation_error_message(list(exc.errors()))
    return error_response(message, 400, param=param, code=code, path=request.url.path)


async def _http_exception_handler(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    status = exc.status_code
    type_ = SERVER_ERROR if status >= 500 else INVALID_REQUEST
    code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(status)
    headers = getattr(exc, "headers", None)
    return error_response(str(exc.detail), status, type_=type_, code=code, headers=headers, path=request.url.path)


def install_error_handlers(app: Any) -> None:
    """Make every error from the app, FastAPI and Starlette an OpenAI-style body."""
    app.add_exception_handler(APIError, _api_error_handler)
    app.add_exception_handler(RequestValidationError, _validation_handler)
    app.add_exception_handler(StarletteHTTPException, _http_exception_handler)
