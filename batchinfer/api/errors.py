"""The API's errors, in the shape of the door they came through.

An :class:`ApiError` (raised by any handler) carries an HTTP status and a message; the handlers
of :func:`exception_handlers` (create_app installs them) render it, and Starlette's own
``HTTPException`` (an unknown route: 404, a wrong method: 405), as the vendor's SDK parses it:

- OpenAI (every path but ``/v1/messages...``): ``{"error": {"message", "type", "param", "code"}}``;
- Anthropic (``/v1/messages...``): ``{"type": "error", "error": {"type", "message"}}``.

Any other exception is a 500 in the same shape, logged with its traceback by the access-log
middleware (batchinfer/api/app.py), never shown to the caller.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Match

ANTHROPIC_PREFIX = "/v1/messages"

# Anthropic's error types by status (docs.anthropic.com, "Errors"); other 4xx: invalid_request_error.
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error"}


class ApiError(Exception):
    """An error answered to the caller: ``status`` (HTTP), ``message`` (says what was wrong and
    where), and OpenAI's ``code`` / ``param`` / ``type`` (``type`` by status when not given; the
    Anthropic shape always takes its type from the status)."""

    def __init__(self, status: int, message: str, *, code: str | None = None, param: str | None = None,
                 type: str | None = None, headers: Mapping[str, str] | None = None):  # noqa: A002 (OpenAI's name)
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.type = type
        self.headers = headers


def openai_error_body(e: ApiError) -> dict[str, Any]:
    """``{"error": {"message", "type", "param", "code"}}`` as the openai SDK parses it (a 401 without
    a code gets ``invalid_api_key``, OpenAI's)."""
    kind = e.type or ("server_error" if e.status >= 500 else "invalid_request_error")
    code = e.code if e.code is not None or e.status != 401 else "invalid_api_key"
    return {"error": {"message": e.message, "type": kind, "param": e.param, "code": code}}


def anthropic_error_body(e: ApiError) -> dict[str, Any]:
    """``{"type": "error", "error": {"type", "message"}}`` as the anthropic SDK parses it."""
    kind = "api_error" if e.status >= 500 else _ANTHROPIC_TYPES.get(e.status, "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": e.message}}


def is_anthropic(path: str) -> bool:
    """Whether ``path`` is Anthropic's door (its errors take Anthropic's shape)."""
    return path == ANTHROPIC_PREFIX or path.startswith(ANTHROPIC_PREFIX + "/")


def error_response(path: str, e: ApiError) -> JSONResponse:
    """``e`` as the JSON response of the door ``path`` belongs to."""
    body = anthropic_error_body(e) if is_anthropic(path) else openai_error_body(e)
    return JSONResponse(body, status_code=e.status, headers=e.headers)


def internal_error() -> ApiError:
    """The 500 answered for an unexpected exception (its details stay in the server's log)."""
    return ApiError(500, "The server had an error while processing your request (it is logged); "
                         "retry, or tell the operator if it persists.")


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return error_response(request.url.path, exc)


async def _http_exception(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    method, path = request.method, request.url.path
    if exc.status_code == 404:
        message = f"Invalid URL ({method} {path}): no such endpoint."
    elif exc.status_code == 405:
        allowed = _allowed_methods(request)
        message = f"Method {method} not allowed for {path}" + (f" (allowed: {allowed})." if allowed else ".")
        return error_response(path, ApiError(405, message, headers={"Allow": allowed} if allowed else None))
    else:
        message = str(exc.detail)
    return error_response(path, ApiError(exc.status_code, message, headers=exc.headers))


def _allowed_methods(request: Request) -> str:
    """The methods of every route at the request's path (Starlette's 405 names only the first's)."""
    methods: set[str] = set()
    for route in request.app.router.routes:
        match, _ = route.matches(request.scope)
        if match is not Match.NONE:
            methods |= set(getattr(route, "methods", None) or ())
    return ", ".join(sorted(methods))


def exception_handlers() -> dict[Any, Any]:
    """Starlette's ``exception_handlers`` argument: ApiError and HTTPException in the door's shape."""
    return {ApiError: _api_error, HTTPException: _http_exception}


__all__ = ["ApiError", "anthropic_error_body", "error_response", "exception_handlers", "internal_error",
           "is_anthropic", "openai_error_body"]
