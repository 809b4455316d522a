"""Who is calling: the API key of a request.

OpenAI's SDK sends ``Authorization: Bearer <key>``, Anthropic's ``x-api-key: <key>``; either works
on every path. The key is looked up on every call (:meth:`ApiKeys.authenticate` reads Redis), so a
revoke is effective at once. With ``api_auth = "none"`` every caller is the anonymous key.
"""

from __future__ import annotations

from starlette.requests import Request

from batchinfer.api.app import context
from batchinfer.api.errors import ApiError
from batchinfer.store.apikeys import ANONYMOUS, ApiKey

MISSING = ("Missing API key: send it as 'Authorization: Bearer <key>' (OpenAI SDKs) or 'x-api-key: <key>' "
           "(Anthropic SDKs); `batchinfer api-keys create NAME` makes one.")
INVALID = "Incorrect API key provided: it is unknown or was revoked."


def presented_secret(request: Request) -> str | None:
    """The secret the request carries (``Authorization: Bearer`` first, then ``x-api-key``), or None."""
    header = request.headers.get("authorization", "")
    scheme, _, value = header.partition(" ")
    if scheme.lower() == "bearer" and value.strip():
        return value.strip()
    return request.headers.get("x-api-key", "").strip() or None


def authenticate(request: Request) -> ApiKey:
    """The caller's :class:`ApiKey` (also set as ``request.state.key``, which the access log names);
    ``ApiError(401)`` for a missing, unknown or revoked key. Blocking (one Redis read): from an
    ``async def`` handler call it through ``starlette.concurrency.run_in_threadpool``."""
    ctx = context(request)
    if ctx.settings.api_auth == "none":
        key = ANONYMOUS
    else:
        secret = presented_secret(request)
        if secret is None:
            raise ApiError(401, MISSING)
        found = ctx.api_keys.authenticate(secret)
        if found is None:
            raise ApiError(401, INVALID)
        key = found
    request.state.key = key
    return key


__all__ = ["authenticate", "presented_secret"]
