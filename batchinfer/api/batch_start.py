"""Starting an OpenAI batch of the HTTP API: the rq job :func:`start_batch` (run by the exporter)
validates the input file, then submits it as the batch's job.

``POST /v1/batches`` records the batch (``validating``) and enqueues this job
(:func:`batchinfer.jobs.api_batches.enqueue_start`). It reads the input file from the file store,
checks it as OpenAI does (:func:`batchinfer.api.validation.validate_batch_lines`), checks the key's
queued-requests limit, and either fails the batch with its errors or submits the file with
``Client.submit`` as the batch's job (job id = batch id, output and error files in the file store,
OpenAI's line format, the key as tenant). It lives here, above the client in the package graph
(``batchinfer.jobs`` is below it: the client enqueues exports), and rq imports it by name.

A cancel racing this: the batch moves ``validating -> submitted`` (compare-and-set) before the job
is opened, so a cancel either wins that race (the batch ends ``cancelled`` and nothing is
submitted) or comes after it and cancels the job.
"""

from __future__ import annotations

import io
import logging
from collections.abc import Iterator
from typing import IO, Any

import redis

from batchinfer.api.validation import LineError, validate_batch_lines
from batchinfer.client.client import Client
from batchinfer.config import Settings
from batchinfer.keys import Keys
from batchinfer.redis_conn import connect
from batchinfer.store.apibatches import ApiBatch, ApiBatches, BatchState
from batchinfer.store.apikeys import ANONYMOUS, ApiKeys
from batchinfer.store.filestore import FileObject, FileStore
from batchinfer.store.jobstore import JobStore

log = logging.getLogger(__name__)

_READ_BUFFER = 1 << 20


def start_batch(batch_id: str, prefix: str | None = None, redis_url: str | None = None) -> str:
    """Validate API batch ``batch_id``'s input file and submit it as its job; returns what happened
    (``failed``, ``submitted``, or why nothing was done). Arguments are JSON values (an rq job).

    Runs again harmlessly: a batch no longer ``validating`` is left alone, except one marked
    ``submitted`` whose job does not exist (an earlier run died in between), which is submitted now.
    A submission refused for good (``ValueError``: e.g. an output the operator's settings do not
    allow) fails the batch at once; any other error is raised for rq to retry, and after the last
    retry the batch fails with it (never left ``validating`` for ever).
    """
    settings = Settings.from_env(prefix=prefix)
    r = _connection(redis_url, settings)
    keys = settings.keys()
    try:
        return _start(r, keys, settings, batch_id)
    except Exception as e:
        if _last_attempt():
            _give_up(r, keys, batch_id, f"{type(e).__name__}: {e}")
        raise


def _start(r: redis.Redis, keys: Keys, settings: Settings, batch_id: str) -> str:
    batches, files = ApiBatches(r, keys), FileStore(r, keys, settings)
    batch = batches.read(batch_id)
    if batch is None:
        return "no such batch"
    if batch.state is BatchState.SUBMITTED:
        if JobStore(r, keys).get(batch_id) is not None:
            return "submitted already"
        source = files.get(batch.input_file_id or "", batch.owner)
        if source is None:
            return _give_up(r, keys, batch_id, f"the input file {batch.input_file_id} no longer exists")
        return _submit(r, keys, settings, files, batch, source, _model(files, source, batch, settings))
    if batch.state is not BatchState.VALIDATING:
        return f"batch is {batch.state.value}"
    source = files.get(batch.input_file_id or "", batch.owner)
    if source is None:
        return _fail(batches, batch, [LineError(
            "file_not_found", f"The input file {batch.input_file_id} no longer exists.", None,
            "input_file_id")], None)
    check = validate_batch_lines(_bounded_lines(files, source, settings.max_line_bytes), batch.endpoint,
                                 max_requests=settings.api_max_batch_requests,
                                 max_line_bytes=settings.max_line_bytes)
    if not check.ok:
        return _fail(batches, batch, check.errors, check.requests)
    over = _over_limit(r, keys, settings, batch, check.requests)
    if over is not None:
        return _fail(batches, batch, [over], check.requests)
    if not batches.set_state(batch_id, BatchState.SUBMITTED, total=check.requests):
        return "cancelled before it was submitted"
    return _submit(r, keys, settings, files, batch, source, check.model)


def _last_attempt() -> bool:
    """Whether this is the final try: outside rq, or an rq job with no retry left."""
    from rq import get_current_job

    job = get_current_job()
    return job is None or not job.retries_left


def _give_up(r: redis.Redis, keys: Keys, batch_id: str, why: str) -> str:
    """Fail a batch that could not be started (still validating, or marked submitted with no job)."""
    error = {"code": "batch_start_failed", "message": f"The batch could not be started: {why}", "line": None,
             "param": None}
    batches = ApiBatches(r, keys)
    if not batches.set_state(batch_id, BatchState.FAILED, errors=[error]) \
            and JobStore(r, keys).get(batch_id) is None:
        batches.set_state(batch_id, BatchState.FAILED, expect=BatchState.SUBMITTED, errors=[error])
    log.warning("batch %s failed to start: %s", batch_id, why)
    return "failed"


def _connection(redis_url: str | None, settings: Settings) -> redis.Redis:
    """``redis_url``, else the connection of the rq job running this (when rq shares the data Redis:
    no ``rq_redis_url``), else the settings' Redis."""
    from rq import get_current_job

    job = get_current_job() if not redis_url else None
    if job is not None and not settings.rq_redis_url:
        return job.connection
    if redis_url:
        return connect(redis_url, settings.redis_ca_file, cluster=settings.cluster())
    return settings.connect()


def _fail(batches: ApiBatches, batch: ApiBatch, errors: list[LineError], total: int | None) -> str:
    batches.set_state(batch.id, BatchState.FAILED, errors=[e.to_dict() for e in errors], total=total)
    log.info("batch %s failed validation: %s", batch.id, "; ".join(e.message for e in errors[:3]))
    return "failed"


def _model(files: FileStore, source: FileObject, batch: ApiBatch, settings: Settings) -> str | None:
    """The model of a file validated by an earlier run (read again: the check is cheap)."""
    return validate_batch_lines(_bounded_lines(files, source, settings.max_line_bytes), batch.endpoint,
                                max_requests=settings.api_max_batch_requests,
                                max_line_bytes=settings.max_line_bytes).model


def _submit(r: redis.Redis, keys: Keys, settings: Settings, files: FileStore, batch: ApiBatch,
            source: FileObject, model: str | None) -> str:
    """Submit the file as the batch's job (``Client.submit``: the same stream every producer sends)."""
    client = Client(settings=settings, connection=r)  # the rq job's connection, not a second one
    try:
        client.submit(_stream(files, source), model, job_id=batch.id,
                      completion_window=batch.completion_window, metadata=batch.metadata,
                      output=files.location(batch.output_file_id or ""),
                      error_output=files.location(batch.error_file_id or ""), output_format="openai",
                      tenant=batch.owner, input_format="jsonl")
    except ValueError as e:
        if client.store.get(batch.id) is None:  # refused before the job existed
            return _give_up(r, keys, batch.id, str(e))
        # the job exists: another run opened it, or the client cancelled it, saying why in its record
        return f"submission stopped: {e}"
    return "submitted"


def _over_limit(r: redis.Redis, keys: Keys, settings: Settings, batch: ApiBatch, n: int) -> LineError | None:
    """An error when ``n`` more requests would pass the owner's queued-requests limit: the requests
    without a row yet of the owner's submitted batches (both kinds) whose jobs have not ended."""
    key = ApiKeys(r, keys).get(batch.owner) or ANONYMOUS  # (the anonymous key has no record)
    limit = key.limit("max_queued_requests", settings)
    queued = ApiBatches(r, keys).queued_requests(batch.owner, exclude=batch.id)
    if queued + n <= limit:
        return None
    return LineError("request_limit_exceeded", f"This batch's {n} requests and the {queued} still queued in "
                     f"this key's unfinished batches would pass its limit of {limit} queued requests; wait "
                     "for those batches to finish, or ask for a higher limit.", None)


# -- reading the input file ------------------------------------------------------------------------


class _ChunkReader(io.RawIOBase):
    """A file-store file's chunks as a raw binary stream (``name``: the file's name, for the job record)."""

    def __init__(self, chunks: Iterator[bytes], name: str):
        self._chunks, self._left, self.name = chunks, b"", name

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:  # a writable buffer
        while not self._left:
            self._left = next(self._chunks, b"")
            if not self._left:
                return 0
        n = min(len(buffer), len(self._left))
        buffer[:n] = self._left[:n]
        self._left = self._left[n:]
        return n


def _stream(files: FileStore, f: FileObject) -> IO[bytes]:
    return io.BufferedReader(_ChunkReader(iter(files.read(f)), f.filename), _READ_BUFFER)


def _bounded_lines(files: FileStore, f: FileObject, max_line_bytes: int) -> Iterator[bytes]:
    """The file's lines without their newline, numbered as ``batchinfer submit`` numbers them; a line
    over ``max_line_bytes`` is given as its first ``max_line_bytes + 1`` bytes (never held whole)."""
    with _stream(files, f) as stream:
        while True:
            raw = stream.readline(max_line_bytes + 1)
            if not raw:
                return
            if raw.endswith(b"\n"):
                yield raw[:-1]
                continue
            yield raw
            if len(raw) > max_line_bytes:
                while (rest := stream.readline(_READ_BUFFER)) and not rest.endswith(b"\n"):
                    pass
