"""Synchronous endpoints over the queue (docs/api.md, "Synchronous endpoints").

``POST /v1/chat/completions``, ``/v1/completions``, ``/v1/embeddings``, ``/v1/responses`` (OpenAI
objects) and ``/v1/messages`` (an Anthropic Message): each request goes in as a *direct* request,
the body wrapped as an OpenAI Batch line (``custom_id, method, url, body``) or an Anthropic line
(``custom_id, params``), so the scheduler validates it as any batch line and its row carries the
endpoint; with a private reply stream, ``hold_seconds 0`` (a model nobody serves is answered at
once) and the entry's ``priority`` = ``api_sync_priority``, above batch jobs. The row that comes
back is shaped by the batch output code (``openai_body``, ``anthropic_lines.message``).

Waiting is asynchronous (``redis.asyncio``, ``XREAD BLOCK`` in short slices), so concurrent requests
hold no threads; between slices the handler asks whether its client went away, and if so cancels
its request (``{p}:cancelled:requests``, docs/protocol.md "Cancelling a direct request"), as it does
when ``api_sync_timeout_seconds`` pass (504). ``GET /v1/models`` lists the names live workers serve.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import Mapping
from typing import Any, cast

import redis
import redis.asyncio as aioredis
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from batchinfer.api.app import ApiContext, context, json_body
from batchinfer.api.auth import authenticate
from batchinfer.api.errors import ApiError
from batchinfer.config import Settings
from batchinfer.jobs.anthropic_lines import message
from batchinfer.jobs.openai_lines import openai_body
from batchinfer.keys import Keys
from batchinfer.protocol.entries import (
    CHAT_URL,
    COMPLETIONS_URL,
    EMBEDDINGS_URL,
    MESSAGES_URL,
    RESPONSES_URL,
    IntakeEntry,
)
from batchinfer.protocol.rows import now_ms
from batchinfer.redis_conn import (
    DEFAULT_URL,
    as_text,
    async_sentinel_client,
    in_cluster,
    is_sentinel_url,
    parse_sentinel_url,
)
from batchinfer.store import replies
from batchinfer.store.queue_state import served_models

log = logging.getLogger(__name__)

SLICE_S = 0.5  # XREAD BLOCK slice: how soon a client that went away is noticed
SERVED_TTL_S = 1.0  # served names are re-read at most this often while a model is found in them
REAP_S = 5.0  # how long a cancelled request's reply stream waits for its row before it is deleted
STREAMING = ("stream: true is not supported: this server answers with the whole response at once. "
             "Send the request without 'stream' (or with stream: false); for many requests, a batch "
             "(/v1/batches, /v1/messages/batches) costs less.")
# A failed row's error_code -> the HTTP status it is answered with (any other: 500)
ERROR_STATUS = {"invalid_request": 400, "invalid_json": 400, "prompt_too_long": 400, "unsupported_url": 400,
                "protocol_error": 400, "line_too_long": 413, "unknown_model": 404}


# -- pure: the line sent, the answer of a row ----------------------------------------------------


def direct_line(url: str, body: Mapping[str, Any], custom_id: str) -> dict[str, Any]:
    """The intake body of a synchronous request: an Anthropic line for ``/v1/messages``, else an
    OpenAI Batch line, so that the row carries ``url`` and the scheduler names fields as the vendor does."""
    if url == MESSAGES_URL:
        return {"custom_id": custom_id, "params": dict(body)}
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": dict(body)}


def intake_entry(url: str, body: Mapping[str, Any], settings: Settings, reply_to: str) -> IntakeEntry:
    """The direct request of a synchronous call: its own reply stream, answered at once when its model
    is not served (``hold_seconds`` 0), at ``api_sync_priority`` (an entry field: neither a Responses
    body nor Anthropic ``params`` has a ``priority``)."""
    line = direct_line(url, body, f"sync-{uuid.uuid4().hex}")
    return IntakeEntry(body=json.dumps(line, ensure_ascii=False, separators=(",", ":")), reply_to=reply_to,
                       hold_seconds=0, priority=settings.api_sync_priority)


def answer(url: str, row: Mapping[str, Any]) -> dict[str, Any]:
    """The response object of a completed ``row`` (an Anthropic Message for ``/v1/messages``, else
    OpenAI's object of the endpoint); ``ApiError`` for a row that did not complete, with a status by
    its ``error_code`` (:data:`ERROR_STATUS`)."""
    if row.get("status") != "completed":
        code = str(row.get("error_code") or row.get("status") or "error")
        text = row.get("error_message") or f"the request ended {row.get('status')}"
        raise ApiError(ERROR_STATUS.get(code, 500), f"{text}", code=code)
    if url == MESSAGES_URL:
        out = message(row)
        out["usage"]["service_tier"] = "standard"  # not a batch: answered as it ran
        return out
    return openai_body({**row, "url": url})


def model_not_served(model: str, served: list[str]) -> ApiError:
    names = ", ".join(served) if served else "none (no worker is running)"
    return ApiError(404, f"The model '{model}' does not exist or is not served now; served models: {names}.",
                    code="model_not_found", param="model")


# -- the Redis edge ---------------------------------------------------------------------------------


def _async_redis(request: Request, settings: Settings, cluster: bool) -> aioredis.Redis:
    """The app's asyncio Redis client for the running event loop (made on first use; a client is
    bound to the loop it was made on); ``cluster``: a Redis Cluster's (as the app's own client)."""
    loop = asyncio.get_running_loop()
    made = getattr(request.app.state, "sync_redis", None)
    if made is not None and made[0] is loop:
        return made[1]
    kwargs: dict[str, Any] = {"client_name": "batchinfer-api"}
    url = settings.redis_url or DEFAULT_URL
    if url.startswith("rediss") and settings.redis_ca_file:
        kwargs["ssl_ca_certs"] = settings.redis_ca_file
    if is_sentinel_url(url):  # the master, found (and followed across a failover) through Sentinel
        client = async_sentinel_client(parse_sentinel_url(url), kwargs)
    elif cluster:  # every command here names one key: it goes to that key's master
        from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster

        client = cast(aioredis.Redis, AsyncRedisCluster.from_url(url, **kwargs))
    else:
        client = aioredis.Redis.from_url(url, **kwargs)
    request.app.state.sync_redis = (loop, client)
    return client


async def _check_served(request: Request, ctx: ApiContext, model: str) -> None:
    """404 naming the served names unless a live worker serves ``model`` (a cached list answers only
    a hit: a miss is re-read, so a model that just came up is never refused)."""
    cached = getattr(request.app.state, "sync_served", None)
    if cached is not None and time.monotonic() - cached[0] < SERVED_TTL_S and model in cached[1]:
        return
    served = set(await run_in_threadpool(served_models, ctx.redis, ctx.keys))
    request.app.state.sync_served = (time.monotonic(), served)
    if model not in served:
        raise model_not_served(model, sorted(served))


async def _cancel(request: Request, r: aioredis.Redis, keys: Keys, request_id: str, reply: str) -> None:
    """``Client.cancel_request``'s write, from the event loop; then, in the background, the reply
    stream is deleted once the ``cancelled`` row has come (else that row would make it anew, kept for
    the reply streams' 7 days)."""
    await r.zadd(keys.cancelled_requests, {request_id: now_ms()})
    reaping: set[asyncio.Task[None]] | None = getattr(request.app.state, "sync_reaping", None)
    if reaping is None:
        reaping = request.app.state.sync_reaping = set()
    task = asyncio.create_task(_reap(r, reply))
    reaping.add(task)  # held until done: the loop keeps only weak references to tasks
    task.add_done_callback(reaping.discard)


async def _reap(r: aioredis.Redis, reply: str) -> None:
    with contextlib.suppress(redis.RedisError):
        await r.xread({reply: "0-0"}, count=1, block=int(REAP_S * 1000))
        await r.delete(reply)


async def _wait_row(request: Request, r: aioredis.Redis, reply: str, timeout: float) -> dict[str, Any] | None:
    """The row on ``reply``; None when the client went away first. ``TimeoutError`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError
        got = replies.read_streams(await r.xread({reply: "0-0"}, count=1,
                                                 block=max(1, int(min(SLICE_S, left) * 1000))))
        if got:
            fields = got[0][1][0][1]
            row: dict[str, Any] = json.loads(fields[b"row"])
            return row
        if await request.is_disconnected():
            return None


# -- the handlers -----------------------------------------------------------------------------------


async def sync_request(request: Request) -> Response:
    """One synchronous request of the endpoint its path names (the five POST routes)."""
    url = request.url.path
    ctx = context(request)
    settings = ctx.settings
    key = await run_in_threadpool(authenticate, request)
    body = await json_body(request)
    if body.get("stream") not in (None, False):
        raise ApiError(400, STREAMING, param="stream")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ApiError(400, "'model' is required: the name of a served model (GET /v1/models lists them).",
                       param="model")
    await _check_served(request, ctx, model)
    r, keys = _async_redis(request, settings, in_cluster(ctx.redis)), ctx.keys
    reply = keys.reply(f"sync-{uuid.uuid4().hex}")
    entry = intake_entry(url, body, settings, reply)
    if not ctx.client.partitions_checked:  # once per server: no thread hop once it is
        await run_in_threadpool(ctx.client.check_partitions)
    part = keys.for_direct(entry.client_request_id)
    request_id = part.direct_id(as_text(await r.xadd(part.requests, replies.xadd_fields(entry.to_fields()))))
    try:
        row = await _wait_row(request, r, reply, settings.api_sync_timeout_seconds)
    except TimeoutError:
        await _cancel(request, r, keys, request_id, reply)
        log.warning("sync %s %s for key %s: no answer within %g s; cancelled", url, request_id, key.name,
                    settings.api_sync_timeout_seconds)
        raise ApiError(504, f"No answer within {settings.api_sync_timeout_seconds:g} s (the queue is busy); "
                            "the request was cancelled. Retry later, or send it in a batch.",
                       code="timeout") from None
    except asyncio.CancelledError:  # the server is stopping: the request is nobody's now
        with contextlib.suppress(Exception):
            await r.zadd(keys.cancelled_requests, {request_id: now_ms()})
        raise
    if row is None:
        await _cancel(request, r, keys, request_id, reply)
        log.info("sync %s %s for key %s: the client went away; cancelled", url, request_id, key.name)
        return Response(status_code=499)  # nobody reads it (nginx's "client closed request")
    with contextlib.suppress(redis.RedisError):
        await r.delete(reply)
    return JSONResponse(answer(url, row))


def _model_objects(ctx: ApiContext) -> list[dict[str, Any]]:
    """The served names as OpenAI Model objects; ``created``: when their model was registered."""
    served = served_models(ctx.redis, ctx.keys)
    raw = ctx.redis.hgetall(ctx.keys.model_aliases)
    aliases = {as_text(a, "replace"): as_text(m, "replace") for a, m in raw.items()}
    pipe = ctx.redis.pipeline(transaction=False)
    for name in served:
        pipe.hget(ctx.keys.model(aliases.get(name, name)), "registered_at")
    created = pipe.execute() if served else []
    return [{"id": name, "object": "model", "created": int(at or 0) // 1000, "owned_by": "batchinfer"}
            for name, at in zip(served, created, strict=True)]


def list_models(request: Request) -> Response:
    """``GET /v1/models``: the names live workers serve (models, adapters, aliases)."""
    authenticate(request)
    return JSONResponse({"object": "list", "data": _model_objects(context(request))})


def get_model(request: Request) -> Response:
    """``GET /v1/models/{model}``: one served name, else 404 naming the served ones."""
    authenticate(request)
    name = request.path_params["model"]
    models = _model_objects(context(request))
    for obj in models:
        if obj["id"] == name:
            return JSONResponse(obj)
    raise model_not_served(name, [m["id"] for m in models])


# Errors take the door's shape (errors.is_anthropic): /v1/messages Anthropic's, the others OpenAI's
SYNC_URLS = (CHAT_URL, COMPLETIONS_URL, EMBEDDINGS_URL, RESPONSES_URL, MESSAGES_URL)

ROUTES = [*(Route(url, sync_request, methods=["POST"]) for url in SYNC_URLS),
          Route("/v1/models", list_models, methods=["GET"]),
          Route("/v1/models/{model:path}", get_model, methods=["GET"])]

__all__ = ["ROUTES", "answer", "direct_line", "intake_entry"]
