"""OpenAI's Batch API: ``POST /v1/batches``, ``GET /v1/batches``, ``GET /v1/batches/{batch_id}`` and
``POST /v1/batches/{batch_id}/cancel``.

Creating a batch records it (``validating``, its output and error file ids allocated) and enqueues
:func:`batchinfer.api.batch_start.start_batch` on the exporter's rq queue, which validates the
input file and submits it as the batch's job (job id = batch id). Everything after that is the
job record's, read on every call: any replica answers for any batch.
"""

from __future__ import annotations

import time
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from batchinfer.api.app import ApiContext, context, json_body
from batchinfer.api.auth import authenticate
from batchinfer.api.batch_objects import openai_batch
from batchinfer.api.errors import ApiError
from batchinfer.api.files_routes import list_body
from batchinfer.api.validation import ENDPOINTS
from batchinfer.client.client import JobNotFound
from batchinfer.jobs.api_batches import enqueue_start
from batchinfer.protocol.entries import parse_duration
from batchinfer.protocol.rows import now_ms
from batchinfer.store.apibatches import ApiBatch, ApiBatches, BatchKind, BatchState
from batchinfer.store.apikeys import ApiKey
from batchinfer.store.jobstore import JobRecord

MAX_CREATE_BODY = 1 << 20  # a create call's JSON (ids, endpoint, window, metadata)
MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512  # OpenAI's
MAX_LIST_LIMIT, DEFAULT_LIST_LIMIT = 100, 20
CREATE_FIELDS = ("input_file_id", "endpoint", "completion_window", "metadata", "output_expires_after")
JOB_APPEAR_S = 5.0  # how long a cancel waits for a just-submitted batch's job to be opened


def not_found(batch_id: str) -> ApiError:
    return ApiError(404, f"No such Batch object: {batch_id}", param="batch_id")


def _record(ctx: ApiContext, batch: ApiBatch) -> JobRecord | None:
    return ctx.client.store.get(batch.id) if batch.state is BatchState.SUBMITTED else None


def _own_batch(ctx: ApiContext, key: ApiKey, batch_id: str) -> ApiBatch:
    batch = ctx.batches.get(batch_id, key.id)
    if batch is None or batch.kind is not BatchKind.OPENAI:
        raise not_found(batch_id)
    return batch


# -- create ----------------------------------------------------------------------------------------


async def create_batch(request: Request) -> Response:
    """``POST /v1/batches``: ``input_file_id``, ``endpoint``, ``completion_window``, ``metadata``."""
    key = await run_in_threadpool(authenticate, request)
    body = await json_body(request, MAX_CREATE_BODY)
    return JSONResponse(await run_in_threadpool(_create, context(request), key, body))


def _create(ctx: ApiContext, key: ApiKey, body: dict[str, Any]) -> dict[str, Any]:
    unknown = sorted(k for k in body if k not in CREATE_FIELDS)
    if unknown:
        raise ApiError(400, f"Unrecognized request argument supplied: {', '.join(unknown)}", param=unknown[0])
    input_file_id, endpoint, window = (_required(body, name) for name in CREATE_FIELDS[:3])
    if endpoint not in ENDPOINTS:
        raise ApiError(400, f"Invalid endpoint {endpoint!r}: this server runs batches of "
                            f"{', '.join(ENDPOINTS)}.", param="endpoint", code="invalid_value")
    try:
        parse_duration(window)
    except ValueError as e:
        raise ApiError(400, f"Invalid completion_window {window!r}: {e} (OpenAI's is '24h').",
                       param="completion_window", code="invalid_value") from None
    metadata = _metadata(body.get("metadata"))
    _check_output_expiry(body.get("output_expires_after"))
    source = ctx.files.get(input_file_id, key.id)
    if source is None:
        raise ApiError(400, f"Invalid 'input_file_id': no file {input_file_id!r} (upload it with "
                            "POST /v1/files first).", param="input_file_id", code="file_not_found")
    if source.purpose != "batch":
        raise ApiError(400, f"The input file {input_file_id} was uploaded with purpose {source.purpose!r}; "
                            "a batch's input needs purpose 'batch'.", param="input_file_id",
                       code="invalid_value")
    batch_id = ApiBatches.new_id(BatchKind.OPENAI)
    output_id, error_id = ctx.files.new_id(), ctx.files.new_id()
    ctx.files.add_output(output_id, key.id, f"{batch_id}_output.jsonl")
    ctx.files.add_output(error_id, key.id, f"{batch_id}_error.jsonl")
    batch = ApiBatch(id=batch_id, kind=BatchKind.OPENAI, owner=key.id, endpoint=endpoint,
                     input_file_id=input_file_id, output_file_id=output_id, error_file_id=error_id,
                     completion_window=window, metadata=metadata, created_at=now_ms())
    ctx.batches.create(batch)
    enqueue_start(ctx.redis, ctx.settings, batch_id)
    return openai_batch(batch, None)


def _required(body: dict[str, Any], name: str) -> str:
    value = body.get(name)
    if value is None:
        raise ApiError(400, f"Missing required parameter: '{name}'.", param=name,
                       code="missing_required_parameter")
    if not isinstance(value, str) or not value:
        raise ApiError(400, f"Invalid type for '{name}': expected a non-empty string.", param=name,
                       code="invalid_type")
    return value


def _metadata(value: Any) -> dict[str, str]:
    """OpenAI's metadata: at most 16 string pairs, keys up to 64 and values up to 512 characters."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ApiError(400, "Invalid type for 'metadata': expected an object of strings.", param="metadata",
                       code="invalid_type")
    if len(value) > MAX_METADATA_PAIRS:
        raise ApiError(400, f"Invalid 'metadata': at most {MAX_METADATA_PAIRS} pairs, got {len(value)}.",
                       param="metadata", code="invalid_value")
    for k, v in value.items():
        if len(k) > MAX_METADATA_KEY:
            raise ApiError(400, f"Invalid 'metadata': key {k[:80]!r} is longer than {MAX_METADATA_KEY} "
                                "characters.", param=f"metadata.{k[:80]}", code="invalid_value")
        if not isinstance(v, str) or len(v) > MAX_METADATA_VALUE:
            raise ApiError(400, f"Invalid 'metadata.{k}': values are strings of at most {MAX_METADATA_VALUE} "
                                "characters.", param=f"metadata.{k}", code="invalid_value")
    return dict(value)


def _check_output_expiry(value: Any) -> None:
    """``output_expires_after`` ({anchor: created_at, seconds: 3600..2592000}) is checked, then left to
    the store: result files expire with ``files_retention_seconds`` (docs/api.md)."""
    if value is None:
        return
    seconds = value.get("seconds") if isinstance(value, dict) else None
    if (not isinstance(value, dict) or value.get("anchor") != "created_at" or not isinstance(seconds, int)
            or not 3600 <= seconds <= 30 * 24 * 3600):
        raise ApiError(400, "Invalid 'output_expires_after': expected {\"anchor\": \"created_at\", "
                            "\"seconds\": 3600 to 2592000}.", param="output_expires_after",
                       code="invalid_value")


# -- read, list, cancel ----------------------------------------------------------------------------


def retrieve_batch(request: Request) -> Response:
    """``GET /v1/batches/{batch_id}``."""
    ctx, key = context(request), authenticate(request)
    batch = _own_batch(ctx, key, request.path_params["batch_id"])
    return JSONResponse(openai_batch(batch, _record(ctx, batch)))


def list_batches(request: Request) -> Response:
    """``GET /v1/batches``: newest first; ``limit`` (1 to 100; 20), ``after`` (a batch id)."""
    ctx, key = context(request), authenticate(request)
    raw = request.query_params.get("limit", str(DEFAULT_LIST_LIMIT))
    if not raw.isdigit() or not 1 <= int(raw) <= MAX_LIST_LIMIT:
        raise ApiError(400, f"limit must be a whole number from 1 to {MAX_LIST_LIMIT}, got {raw!r}.",
                       param="limit")
    page, more = ctx.batches.list(BatchKind.OPENAI, key.id, limit=int(raw),
                                  after=request.query_params.get("after") or None)
    pipe = ctx.redis.pipeline(transaction=False)
    for batch in page:
        pipe.hgetall(ctx.keys.job(batch.id))
    records = [JobRecord.from_hash(fields) if fields and b.state is BatchState.SUBMITTED else None
               for b, fields in zip(page, pipe.execute(), strict=True)]
    return JSONResponse(list_body([openai_batch(b, r) for b, r in zip(page, records, strict=True)], more))


def cancel_batch(request: Request) -> Response:
    """``POST /v1/batches/{batch_id}/cancel``: a batch still validating ends ``cancelled`` at once;
    a running one goes ``cancelling`` (its job's pending requests become cancelled rows, then the
    export writes the partial output); an ended one is answered unchanged."""
    ctx, key = context(request), authenticate(request)
    batch = _own_batch(ctx, key, request.path_params["batch_id"])
    if batch.state is BatchState.VALIDATING:
        ctx.batches.set_state(batch.id, BatchState.CANCELLED)  # loses only to the submission
        batch = _own_batch(ctx, key, batch.id)
    if batch.state is BatchState.SUBMITTED:
        _cancel_job(ctx, batch.id)
    return JSONResponse(openai_batch(batch, _record(ctx, batch)))


def _cancel_job(ctx: ApiContext, job_id: str) -> None:
    """Cancel the batch's job, waiting briefly for it when the submission has just begun."""
    deadline = time.monotonic() + JOB_APPEAR_S
    while True:
        try:
            ctx.client.cancel(job_id)
            return
        except JobNotFound:
            if time.monotonic() >= deadline:
                raise ApiError(409, f"Batch {job_id} is being submitted: retry the cancel in a moment.",
                               code="batch_starting") from None
            time.sleep(0.05)


ROUTES = [
    Route("/v1/batches", create_batch, methods=["POST"]),
    Route("/v1/batches", list_batches, methods=["GET"]),
    Route("/v1/batches/{batch_id}", retrieve_batch, methods=["GET"]),
    Route("/v1/batches/{batch_id}/cancel", cancel_batch, methods=["POST"]),
]
