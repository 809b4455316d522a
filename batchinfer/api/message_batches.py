"""Anthropic Message Batches over HTTP: ``/v1/messages/batches`` (docs/api.md, "Message Batches (Anthropic)").

A message batch is one job whose id is the batch's id: its ``{custom_id, params}`` requests go in
as they are (the scheduler decodes each line's ``params``, so a bad request becomes an ``errored``
result, never a refused batch), and the exporter writes Anthropic's results lines
(``output_format "anthropic"``) into the file store, where ``GET .../results`` streams them from.
The batch's own record (:class:`~batchinfer.store.apibatches.ApiBatch`) holds its owner and where
the results go; the job record says the rest. :func:`message_batch` is the object the SDK parses.
"""

from __future__ import annotations

import contextlib
import itertools
import re
from collections.abc import Iterator, Mapping
from datetime import datetime, timezone
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from batchinfer.api.app import ApiContext, context, json_body
from batchinfer.api.auth import authenticate
from batchinfer.api.errors import ApiError
from batchinfer.protocol.entries import short_repr
from batchinfer.protocol.rows import now_ms
from batchinfer.store.apibatches import ApiBatch, BatchKind, BatchState
from batchinfer.store.apikeys import ApiKey
from batchinfer.store.filestore import FileObject
from batchinfer.store.jobstore import JobRecord, JobStatus

__all__ = ["MAX_REQUESTS", "ROUTES", "check_queue_limit", "message_batch", "parse_requests",
           "processing_status"]

MAX_REQUESTS = 100_000  # requests per message batch (Anthropic's limit)
ENDPOINT = "/v1/messages"
COMPLETION_WINDOW = "24h"  # Anthropic's batches end within 24 hours; not settable there
LIST_DEFAULT, LIST_MAX = 20, 1000
RESULTS_MEDIA_TYPE = "application/x-jsonl"
_CUSTOM_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")
_REQUEST_FIELDS = ("custom_id", "params")
IN_PROGRESS = JobStatus.IN_PROGRESS.value  # Anthropic's processing_status spells it as our job status
_LIVE = (JobStatus.VALIDATING, JobStatus.IN_PROGRESS, JobStatus.FINALIZING)
_UNANSWERED = {JobStatus.EXPIRED: "expired", JobStatus.CANCELLED: "canceled"}  # how rowless requests ended
_DAY_MS = 24 * 3600_000


# -- the MessageBatch object ---------------------------------------------------------------------

def _rfc3339(ms: int | None) -> str | None:
    if ms is None:
        return None
    when = datetime.fromtimestamp(ms / 1000, tz=timezone.utc)
    return when.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def processing_status(record: JobRecord | None) -> str:
    """``ended`` once the job ended and its results file is written (or its export failed for good:
    the job is ``failed`` and no file will come), ``canceling`` while a cancelled job is settling,
    else ``in_progress`` (no job record yet counts as in progress)."""
    if record is None or record.status in _LIVE:
        return IN_PROGRESS
    if record.terminal and (record.exported_at is not None or record.status is JobStatus.FAILED):
        return "ended"
    if record.status in (JobStatus.CANCELLING, JobStatus.CANCELLED):
        return "canceling"
    return IN_PROGRESS  # ended, results file not yet written


def _counts(batch: ApiBatch, record: JobRecord | None, ended: bool) -> dict[str, int]:
    """Anthropic's tallies: every request is ``processing`` until the batch ends, then each is in
    exactly one of the others (requests without a row, if any, count as the way the job ended)."""
    total = (record.total if record is not None else None) or batch.total or 0
    if not ended or record is None:
        return {"processing": total, "succeeded": 0, "errored": 0, "canceled": 0, "expired": 0}
    counts = {"processing": 0, "succeeded": record.completed, "errored": record.failed,
              "canceled": record.cancelled, "expired": record.expired}
    missing = total - record.done
    if missing > 0:
        counts[_UNANSWERED.get(record.status, "errored")] += missing
    return counts


def _ended_at(record: JobRecord) -> int | None:
    by_status = {JobStatus.COMPLETED: record.completed_at, JobStatus.FAILED: record.failed_at,
                 JobStatus.EXPIRED: record.expired_at, JobStatus.CANCELLED: record.cancelled_at}
    return by_status.get(record.status) or record.exported_at


def message_batch(batch: ApiBatch, record: JobRecord | None, base_url: str) -> dict[str, Any]:
    """The batch as Anthropic's ``MessageBatch`` object; ``base_url`` is the server's own
    (``http://host:8000``), for ``results_url``. Times are RFC 3339 strings (UTC)."""
    status = processing_status(record)
    ended = status == "ended"
    expires = batch.created_at + _DAY_MS
    cancel_at = None
    if record is not None:
        expires = record.expires_at or expires
        cancelled = record.cancelled_at if record.status == JobStatus.CANCELLED else None
        cancel_at = record.cancelling_at or cancelled
    return {
        "id": batch.id,
        "type": "message_batch",
        "processing_status": status,
        "request_counts": _counts(batch, record, ended),
        "ended_at": _rfc3339(_ended_at(record)) if ended and record is not None else None,
        "created_at": _rfc3339(batch.created_at),
        "expires_at": _rfc3339(expires),
        "archived_at": None,
        "cancel_initiated_at": _rfc3339(cancel_at),
        "results_url": f"{base_url.rstrip('/')}/v1/messages/batches/{batch.id}/results" if ended else None,
    }


# -- validation (pure) ---------------------------------------------------------------------------

def _bad(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param)


def parse_requests(body: Any, limit: int = MAX_REQUESTS) -> list[dict[str, Any]]:
    """The ``requests`` of a create body, checked as Anthropic checks them before a batch exists: a
    list of 1..``limit`` objects ``{custom_id, params}``, ``custom_id`` 1-64 characters of
    ``[a-zA-Z0-9_-]`` and unique, ``params`` an object (whose contents the scheduler checks, one
    request at a time). Raises a 400 :class:`ApiError` naming the first fault and where it is."""
    if not isinstance(body, Mapping):
        raise _bad(f"the request body must be a JSON object {{\"requests\": [...]}}, got {short_repr(body)}")
    unknown = sorted(str(k) for k in body if k != "requests")
    if unknown:
        raise _bad(f"{unknown[0]}: unknown field (a message batch takes only requests)", unknown[0])
    requests = body.get("requests")
    if not isinstance(requests, list) or not requests:
        raise _bad(f"requests must be a non-empty list of {{custom_id, params}} objects, got "
                   f"{short_repr(requests)}", "requests")
    if len(requests) > limit:
        raise _bad(f"requests: {len(requests)} requests, over the limit of {limit} per message batch",
                   "requests")
    seen: dict[str, int] = {}
    for i, item in enumerate(requests):
        where = f"requests[{i}]"
        if not isinstance(item, Mapping):
            raise _bad(f"{where} must be an object {{custom_id, params}}, got {short_repr(item)}", where)
        extra = sorted(str(k) for k in item if k not in _REQUEST_FIELDS)
        if extra:
            raise _bad(f"{where}.{extra[0]}: unknown field (a request takes custom_id and params)",
                       f"{where}.{extra[0]}")
        custom_id = item.get("custom_id")
        if not isinstance(custom_id, str) or not _CUSTOM_ID.fullmatch(custom_id):
            raise _bad(f"{where}.custom_id must be 1 to 64 characters of letters, digits, '_' and '-', got "
                       f"{short_repr(custom_id)}", f"{where}.custom_id")
        if custom_id in seen:
            raise _bad(f"{where}.custom_id {custom_id!r} is a duplicate of requests[{seen[custom_id]}]."
                       "custom_id (custom_id must be unique within a message batch)", f"{where}.custom_id")
        seen[custom_id] = i
        if not isinstance(item.get("params"), Mapping):
            raise _bad(f"{where}.params must be an object (the Messages API request), got "
                       f"{short_repr(item.get('params'))}", f"{where}.params")
    return requests


# -- reading -------------------------------------------------------------------------------------

def _base_url(request: Request) -> str:
    return str(request.base_url).rstrip("/")


def _find(ctx: ApiContext, key: ApiKey, batch_id: str) -> ApiBatch:
    """The key's message batch ``batch_id``; 404 for none, another key's, or an OpenAI batch."""
    batch = ctx.batches.get(batch_id, key.id)
    if batch is None or batch.kind != BatchKind.ANTHROPIC:
        raise ApiError(404, f"message batch {batch_id!r} not found")
    return batch


def _view(ctx: ApiContext, request: Request, batch: ApiBatch) -> dict[str, Any]:
    return message_batch(batch, ctx.client.store.get(batch.id), _base_url(request))


def _results_file(ctx: ApiContext, batch: ApiBatch, record: JobRecord) -> FileObject:
    """The results file as a file-store object (it has no record of its own: it is not listed)."""
    file_id = batch.output_file_id or batch.id
    return FileObject(id=file_id, owner=batch.owner, filename=f"{batch.id}_results.jsonl",
                      purpose="batch_output", bytes=None, created_at=(record.exported_at or 0) // 1000,
                      expires_at=None, location=record.output or ctx.files.location(file_id), ready=True)


# -- routes --------------------------------------------------------------------------------------

async def create_batch(request: Request) -> Response:
    """``POST /v1/messages/batches``: check the requests, create the batch and submit its job."""
    ctx = context(request)
    key = await run_in_threadpool(authenticate, request)
    body = await json_body(request, ctx.settings.api_max_body_bytes)
    batch, record = await run_in_threadpool(_create, ctx, key, body)
    return JSONResponse(message_batch(batch, record, _base_url(request)))


def _create(ctx: ApiContext, key: ApiKey, body: Any) -> tuple[ApiBatch, JobRecord | None]:
    limit = min(MAX_REQUESTS, ctx.settings.max_requests_per_job)
    requests = parse_requests(body, limit)
    check_queue_limit(ctx, key, len(requests))
    results_id = ctx.files.new_id()  # where the export writes the results (no file record lists it)
    batch = ApiBatch(id=ctx.batches.new_id(BatchKind.ANTHROPIC), kind=BatchKind.ANTHROPIC, owner=key.id,
                     endpoint=ENDPOINT, input_file_id=None, output_file_id=results_id, error_file_id=None,
                     completion_window=COMPLETION_WINDOW, metadata={}, created_at=now_ms(),
                     state=BatchState.SUBMITTED, errors=[], ended_at=None, total=len(requests))
    # The job first, then the batch's record: until the record exists nobody knows the id, so no
    # cancel or read can race the submission (a crash in between leaves a job no key can see).
    ctx.client.submit(requests, job_id=batch.id, output=ctx.files.location(results_id),
                      output_format="anthropic", tenant=key.tenant, completion_window=COMPLETION_WINDOW)
    ctx.batches.create(batch)
    return batch, ctx.client.store.get(batch.id)


def check_queue_limit(ctx: ApiContext, key: ApiKey, adding: int) -> None:
    """429 when the requests still without a result in the key's unfinished batches (both kinds)
    and these ``adding`` would be more than its ``max_queued_requests`` (else
    ``api_max_queued_requests_per_key``): ``ApiBatches.queued_requests``, as OpenAI batches count it."""
    limit = key.limit("max_queued_requests", ctx.settings)
    queued = ctx.batches.queued_requests(key.id)
    if queued + adding > limit:
        raise ApiError(429, f"this key has {queued} requests queued in unfinished batches; {adding} more "
                            f"would pass its limit of {limit}")


def get_batch(request: Request) -> Response:
    """``GET /v1/messages/batches/{id}``."""
    ctx, key = context(request), authenticate(request)
    return JSONResponse(_view(ctx, request, _find(ctx, key, request.path_params["batch_id"])))


def list_batches(request: Request) -> Response:
    """``GET /v1/messages/batches``: the key's batches, newest first; ``after_id`` pages to older
    ones, ``before_id`` to newer ones, ``limit`` 1..1000 (default 20). A cursor that is not one of
    the key's batches gives an empty page."""
    ctx, key = context(request), authenticate(request)
    query = request.query_params
    raw = query.get("limit", str(LIST_DEFAULT))
    try:
        limit = int(raw)
    except ValueError:
        raise _bad(f"limit must be an integer from 1 to {LIST_MAX}, got {raw!r}", "limit") from None
    if not 1 <= limit <= LIST_MAX:
        raise _bad(f"limit must be from 1 to {LIST_MAX}, got {limit}", "limit")
    after, before = query.get("after_id") or None, query.get("before_id") or None
    if after and before:
        raise _bad("give after_id or before_id, not both", "before_id")
    page, more = ctx.batches.list(BatchKind.ANTHROPIC, key.id, limit=limit, after=after, before=before)
    base = _base_url(request)
    records = ctx.client.store.get_many(b.id for b in page)
    data = [message_batch(b, r, base) for b, r in zip(page, records, strict=True)]
    return JSONResponse({"data": data, "has_more": more, "first_id": page[0].id if page else None,
                         "last_id": page[-1].id if page else None})


def cancel_batch(request: Request) -> Response:
    """``POST /v1/messages/batches/{id}/cancel``: the batch goes ``canceling``; its requests not yet
    answered end ``canceled``. An ended batch is returned as it is."""
    ctx, key = context(request), authenticate(request)
    batch = _find(ctx, key, request.path_params["batch_id"])
    with contextlib.suppress(KeyError):  # JobNotFound: a batch whose job is gone reads as it is
        ctx.client.cancel(batch.id)
    return JSONResponse(_view(ctx, request, batch))


def delete_batch(request: Request) -> Response:
    """``DELETE /v1/messages/batches/{id}``: only an ended batch (Anthropic's rule: cancel it
    first); its results file, then its job's and its own records go."""
    ctx, key = context(request), authenticate(request)
    batch = _find(ctx, key, request.path_params["batch_id"])
    record = ctx.client.store.get(batch.id)
    status = processing_status(record)
    if record is not None and status != "ended":
        raise _bad(f"message batch {batch.id!r} is {status}: only an ended batch can be deleted "
                   "(cancel it first, then delete it once it has ended)")
    if record is not None:
        if batch.output_file_id is not None:  # the results' bytes (no file record lists them)
            ctx.files.delete_bytes(batch.output_file_id)
        ctx.client.store.delete(batch.id)
    ctx.batches.delete(batch.id)
    return JSONResponse({"id": batch.id, "type": "message_batch_deleted"})


def batch_results(request: Request) -> Response:
    """``GET /v1/messages/batches/{id}/results`` (the ``results_url``): the results file, streamed,
    one ``{custom_id, result}`` line per request, once the batch has ended."""
    ctx, key = context(request), authenticate(request)
    batch = _find(ctx, key, request.path_params["batch_id"])
    record = ctx.client.store.get(batch.id)
    status = processing_status(record)
    if record is None or status != "ended":
        raise _bad(f"message batch {batch.id!r} is {status}: its results are available once it has ended "
                   "(results_url is set then)")
    chunks = ctx.files.read(_results_file(ctx, batch, record))
    try:
        first = next(chunks, b"")  # opens the file: a missing one answers 404 before any byte is sent
    except FileNotFoundError:
        raise ApiError(404, f"the results of message batch {batch.id!r} are no longer available") from None
    return StreamingResponse(_chain(first, chunks), media_type=RESULTS_MEDIA_TYPE)


def _chain(first: bytes, rest: Iterator[bytes]) -> Iterator[bytes]:
    return itertools.chain([first], rest) if first else rest


ROUTES = [
    Route("/v1/messages/batches", create_batch, methods=["POST"]),
    Route("/v1/messages/batches", list_batches, methods=["GET"]),
    Route("/v1/messages/batches/{batch_id}", get_batch, methods=["GET"]),
    Route("/v1/messages/batches/{batch_id}", delete_batch, methods=["DELETE"]),
    Route("/v1/messages/batches/{batch_id}/cancel", cancel_batch, methods=["POST"]),
    Route("/v1/messages/batches/{batch_id}/results", batch_results, methods=["GET"]),
]
