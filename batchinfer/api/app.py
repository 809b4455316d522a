"""The HTTP API's application: :func:`create_app` builds the Starlette app that ``batchinfer api`` serves.

The app holds no state of its own: everything is in Redis and the file store, reached through
one :class:`ApiContext` (``app.state.ctx``), so any number of replicas serve the same files and
batches. Its routes are the health endpoints here (``/healthz``, ``/readyz``, ``/metrics``, no key
needed) and the ``ROUTES`` of each module in :data:`ROUTE_MODULES`.

Route handlers that call Redis or the file store are plain ``def`` (Starlette runs them in its
thread pool); ``async def`` only where a streamed body or disconnect detection needs it, with
blocking calls through ``starlette.concurrency.run_in_threadpool``. :func:`json_body` reads a JSON
body within a size limit. One middleware writes the access log (method, path, status, ms and the
key's *name*, never its secret), counts the API's metrics and turns an unexpected exception into
a logged 500 in the door's error shape (batchinfer/api/errors.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import redis
from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.exposition import choose_encoder
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import BaseRoute, Match, Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from batchinfer.api.errors import ApiError, error_response, exception_handlers, internal_error
from batchinfer.client.client import Client
from batchinfer.config import Settings
from batchinfer.keys import Keys
from batchinfer.ops.httpserver import Readiness
from batchinfer.ops.metrics import SPECS
from batchinfer.store.apibatches import ApiBatches
from batchinfer.store.apikeys import ApiKeys
from batchinfer.store.filestore import FileStore
from batchinfer.store.registry import check_partitions

log = logging.getLogger(__name__)
access_log = logging.getLogger("batchinfer.api.access")

# The modules whose ``ROUTES`` the app serves, in this order. They import this module (context,
# json_body), so it imports them by name when an app is built: no import circle.
ROUTE_MODULES = ("files_routes", "batches_routes", "message_batches", "sync_routes")
HEALTH_PATHS = ("/healthz", "/readyz", "/metrics")  # no key; logged at DEBUG (probes and scrapes)
UNMATCHED = "unmatched"  # the route label of a path no route matches (bounded label values)
PROBE_TIMEOUT_S = 5.0  # /readyz's own Redis connection: a hung Redis must not hang the probe
# How often each replica deletes expired files (bytes and records). Every replica sweeps: deleting
# is idempotent, so replicas need no leader, and one sweep at start clears what piled up while none ran.
SWEEP_INTERVAL_S = 600.0


@dataclass
class ApiContext:
    """What every handler reaches through :func:`context`: the settings and the stores, all on one
    sync Redis connection pool (the client's)."""

    settings: Settings
    redis: redis.Redis
    keys: Keys
    files: FileStore
    api_keys: ApiKeys
    batches: ApiBatches
    client: Client

    @classmethod
    def create(cls, settings: Settings) -> ApiContext:
        """The context of ``settings`` (connections open lazily: Redis may be down at start)."""
        client = Client(settings=settings)
        r, keys = client.redis, client.keys
        return cls(settings=settings, redis=r, keys=keys, files=FileStore(r, keys, settings),
                   api_keys=ApiKeys(r, keys), batches=ApiBatches(r, keys), client=client)

    def close(self) -> None:
        self.client.close()


def context(request: Request) -> ApiContext:
    """The app's :class:`ApiContext`."""
    ctx: ApiContext = request.app.state.ctx
    return ctx


async def json_body(request: Request, max_bytes: int | None = None) -> dict[str, Any]:
    """The request's JSON object, read a chunk at a time up to ``max_bytes`` (default: the
    ``api_max_body_bytes`` setting). ``ApiError`` 413 past the limit, 400 for a body that is empty,
    not JSON (naming the error's line and column) or not an object."""
    limit = max_bytes if max_bytes is not None else context(request).settings.api_max_body_bytes
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(int(declared), limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(size, limit)
        chunks.append(chunk)
    raw = b"".join(chunks)
    if not raw.strip():
        raise ApiError(400, "The request body is empty: send a JSON object.")
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as e:
        raise ApiError(400, f"invalid JSON in the request body: {e.msg} at line {e.lineno} column "
                            f"{e.colno}.") from None
    except UnicodeDecodeError as e:
        raise ApiError(400, f"invalid JSON in the request body: not UTF-8 text ({e.reason} at byte "
                            f"{e.start}).") from None
    except RecursionError:
        raise ApiError(400, "invalid JSON in the request body: nested too deeply.") from None
    if not isinstance(value, dict):
        raise ApiError(400, f"The request body must be a JSON object, not a JSON {_json_type(value)}.")
    return value


def _too_large(size: int, limit: int) -> ApiError:
    return ApiError(413, f"The request body is too large: {size} bytes or more, over the limit of {limit} "
                         "bytes.", code="request_too_large")


def _json_type(value: Any) -> str:
    names = {list: "array", str: "string", bool: "boolean", int: "number", float: "number"}
    return "null" if value is None else names.get(type(value), type(value).__name__)


# -- health ----------------------------------------------------------------------------------------


def healthz(request: Request) -> Response:
    """Liveness: the process answers."""
    return PlainTextResponse("ok\n")


def readyz(request: Request) -> Response:
    """Readiness: Redis answers ``PING`` and this server's ``BATCHINFER_PARTITIONS`` is the
    deployment's (503 with the reason when not)."""
    ready, report = request.app.state.readiness.check()
    return JSONResponse({"ready": ready, "checks": report}, status_code=200 if ready else 503)


def metrics(request: Request) -> Response:
    """The API process's Prometheus registry (text format, or OpenMetrics when asked for)."""
    encoder, content_type = choose_encoder(request.headers.get("accept", ""))
    return Response(encoder(request.app.state.metrics.registry), media_type=content_type)


HEALTH_ROUTES = [Route("/healthz", healthz, methods=["GET"]), Route("/readyz", readyz, methods=["GET"]),
                 Route("/metrics", metrics, methods=["GET"])]


# -- metrics and the access log --------------------------------------------------------------------


class ApiMetrics:
    """The API's metrics (ops/metrics.py's SPECS: ``batchinfer_api_*``) in their own registry, with
    the process metrics."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)
        made = {}
        for name in ("batchinfer_api_requests_total", "batchinfer_api_request_duration_seconds",
                     "batchinfer_api_requests_in_flight"):
            spec = SPECS[name]
            extra = {"buckets": spec.buckets} if spec.buckets else {}
            made[name] = spec.kind(name, spec.doc, spec.labels, registry=self.registry, **extra)
        self.requests = made["batchinfer_api_requests_total"]
        self.duration = made["batchinfer_api_request_duration_seconds"]
        self.in_flight = made["batchinfer_api_requests_in_flight"]


class AccessLog:
    """ASGI middleware: one log line and the metrics per request; an exception no handler took
    becomes a 500 in the door's shape (logged with its traceback) when no response has started."""

    def __init__(self, app: ASGIApp, routes: list[BaseRoute], metrics: ApiMetrics):
        self.app, self.routes, self.metrics = app, routes, metrics

    def route_of(self, scope: Scope) -> str:
        """The path template of the route the request goes to (as Starlette's router matches)."""
        partial = None
        for route in self.routes:
            match, _ = route.matches(scope)
            if match is Match.FULL:
                return str(getattr(route, "path", UNMATCHED))
            if match is Match.PARTIAL and partial is None:
                partial = str(getattr(route, "path", UNMATCHED))
        return partial or UNMATCHED

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start, route = time.perf_counter(), self.route_of(scope)
        state = scope.setdefault("state", {})  # request.state of the handlers: the key they set
        status: list[int] = []

        async def send_status(message: Message) -> None:
            if message["type"] == "http.response.start":
                status.append(message["status"])
            await send(message)

        in_flight = self.metrics.in_flight.labels(route=route)
        in_flight.inc()
        try:
            await self.app(scope, receive, send_status)
        except Exception:
            log.exception("error answering %s %s", scope["method"], scope["path"])
            if status:  # a response has begun: nothing else can be sent
                raise
            await error_response(scope["path"], internal_error())(scope, receive, send_status)
        finally:
            in_flight.dec()
            self._record(scope, route, status[0] if status else 499, start, state.get("key"))

    def _record(self, scope: Scope, route: str, status: int, start: float, key: Any) -> None:
        elapsed = time.perf_counter() - start
        method = scope["method"]
        self.metrics.requests.labels(route=route, method=method, status=str(status)).inc()
        self.metrics.duration.labels(route=route, method=method).observe(elapsed)
        level = logging.DEBUG if route in HEALTH_PATHS else logging.INFO
        # 499 (nginx's): the client went away before any response
        access_log.log(level, "%s %s %d %.1fms key=%s", method, scope["path"], status, elapsed * 1000,
                       getattr(key, "name", "-"))


# -- the app ---------------------------------------------------------------------------------------


def api_routes() -> list[BaseRoute]:
    """The ``ROUTES`` of every module in :data:`ROUTE_MODULES`, in order."""
    routes: list[BaseRoute] = []
    for name in ROUTE_MODULES:
        module = importlib.import_module(f"batchinfer.api.{name}")
        routes += module.ROUTES
    return routes


def create_app(settings: Settings) -> Starlette:
    """The API's app for ``settings``: health routes, then every route module's; the vendor error
    shapes; the access log. Nothing connects before the first request."""
    ctx = ApiContext.create(settings)
    routes = [*HEALTH_ROUTES, *api_routes()]
    api_metrics = ApiMetrics()

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        sweeper = asyncio.create_task(sweep_expired_files(ctx.files))
        try:
            yield
        finally:
            sweeper.cancel()
            ctx.close()
            probe.close()

    app = Starlette(routes=routes, exception_handlers=exception_handlers(), lifespan=lifespan,
                    middleware=[Middleware(AccessLog, routes=routes, metrics=api_metrics)])
    app.state.ctx = ctx
    app.state.metrics = api_metrics
    probe = settings.connect(socket_timeout=PROBE_TIMEOUT_S)
    readiness = Readiness()
    readiness.add_probe("redis", probe.ping)

    checked: list[bool] = []

    def partitions() -> bool:  # a server under another BATCHINFER_PARTITIONS would misroute requests
        if not checked:  # the deployment's count does not change: once it matched, no more reads
            check_partitions(probe, ctx.keys)
            checked.append(True)
        return True

    readiness.add_probe("partitions", partitions)
    app.state.readiness = readiness
    return app


async def sweep_expired_files(files: FileStore, interval_s: float = SWEEP_INTERVAL_S) -> None:
    """Delete expired files (``BATCHINFER_FILES_RETENTION_SECONDS``) now and every ``interval_s``;
    a failed sweep (Redis or the store unreachable) is logged and tried again next time."""
    while True:
        try:
            removed = await run_in_threadpool(files.sweep_expired)
            if removed:
                log.info("file store: deleted %d expired file(s)", removed)
        except Exception as e:  # the API serves on; the next sweep retries
            log.warning("file store: sweeping expired files failed: %s: %s", type(e).__name__, e)
        await asyncio.sleep(interval_s)


def app_from_env() -> Starlette:
    """``create_app`` with the environment's settings and logging: the factory each process of
    ``batchinfer api --workers N`` imports (the command exports its options to the environment)."""
    from batchinfer.ops.logs import setup_logging

    settings = Settings.from_env()
    setup_logging(settings.log_format, settings.log_level)
    return create_app(settings)


__all__ = ["ROUTE_MODULES", "ApiContext", "api_routes", "app_from_env", "context", "create_app", "json_body",
           "sweep_expired_files"]
