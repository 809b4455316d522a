"""Export a job's results stream to Parquet / JSONL / OpenAI batch output (an rq job).

``export_job`` reads ``{bi}:results:<job>`` in chunks, orders the rows by ``idx`` with bounded
memory (rows are spilled to per-range temporary files, see :class:`IdxSorter`; the same pass
learns the embedding widths, which fix the Parquet schema before its first row group), writes them to a
temporary name and renames it into place (:mod:`batchinfer.jobs.output`); only then does the job
record get its ``output`` and its final status: ``finalizing`` -> ``completed``, ``cancelling`` ->
``cancelled``, ``expired`` stays. A failure is recorded on the job record (``errors``,
``export_error``) and raised, so rq retries it; after the last retry the job is ``failed``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import struct
import tempfile
from collections import defaultdict
from collections.abc import Iterator
from typing import BinaryIO

import pyarrow as pa
import redis

from batchinfer.config import Settings
from batchinfer.jobs.formats import EXTENSIONS, RESULT_SCHEMA, check_format
from batchinfer.jobs.output import resolve, write_rows
from batchinfer.jobs.queueing import (  # noqa: F401 - re-exported: the exporter's public API
    EXPORT_TIMEOUT_S,
    RETRY_INTERVALS,
    enqueue_export,
    rq_job_id,
)
from batchinfer.jobs.vectors import VectorWidths
from batchinfer.keys import Keys
from batchinfer.protocol.rows import now_ms
from batchinfer.redis_conn import as_text
from batchinfer.store import replies, scripts
from batchinfer.store.jobstore import TERMINAL, JobStatus, JobStore

__all__ = ["RESULT_SCHEMA", "IdxSorter", "SortedRows", "confined_output", "enqueue_export", "export_job",
           "iter_stream", "rq_job_id", "sorted_rows", "write_rows"]

log = logging.getLogger(__name__)

STREAM_CHUNK = 1000  # entries per XRANGE
BUCKET_ROWS = 100_000  # rows sorted in memory at once (more for jobs over MAX_BUCKETS buckets)
MAX_BUCKETS = 256  # spill files open at once
_RECORD = struct.Struct("<qI")  # spill record header: idx, length of the row's JSON

# statuses in which every request has its row: the export may run (again, for an ended job)
EXPORTABLE = frozenset({JobStatus.FINALIZING, JobStatus.CANCELLING, *TERMINAL})


def iter_stream(r: redis.Redis, key: str, *, count: int = STREAM_CHUNK, start: str = "-",
                end: str = "+") -> Iterator[tuple[bytes, dict[bytes, bytes]]]:
    """Every entry of stream ``key`` between ``start`` and ``end``, read ``count`` at a time."""
    while True:
        entries = replies.entries(r.xrange(key, min=start, max=end, count=count))
        yield from entries
        if len(entries) < count:
            return
        start = "(" + as_text(entries[-1][0])


class IdxSorter:
    """Orders ``(idx, row JSON)`` pairs by idx in bounded memory; later duplicates of an idx are dropped.

    Rows go to a bucket per ``bucket_rows`` consecutive idx values; buffered buckets are appended
    to their spill file whenever ``buffer_rows`` rows are held. Iterating reads the buckets back
    one at a time, each sorted in memory.
    """

    def __init__(self, directory: str, bucket_rows: int = BUCKET_ROWS, buffer_rows: int = 32_768):
        self.directory = directory
        self.bucket_rows = bucket_rows
        self.buffer_rows = buffer_rows
        self.duplicates = 0
        self._buffers: dict[int, list[tuple[int, bytes]]] = defaultdict(list)
        self._files: dict[int, BinaryIO] = {}
        self._held = 0

    def add(self, idx: int, raw: bytes) -> None:
        self._buffers[idx // self.bucket_rows].append((idx, raw))
        self._held += 1
        if self._held >= self.buffer_rows:
            self._spill()

    def _spill(self) -> None:
        for bucket, items in self._buffers.items():
            f = self._files.get(bucket)
            if f is None:
                path = os.path.join(self.directory, f"bucket-{bucket}.bin")
                f = self._files[bucket] = open(path, "w+b")  # noqa: SIM115 (closed in __iter__ / close)
            f.write(b"".join(_RECORD.pack(i, len(raw)) + raw for i, raw in items))
        self._buffers.clear()
        self._held = 0

    def _read(self, f: BinaryIO) -> Iterator[tuple[int, bytes]]:
        f.flush()
        f.seek(0)
        data = f.read()
        pos = 0
        while pos < len(data):
            idx, size = _RECORD.unpack_from(data, pos)
            pos += _RECORD.size
            yield idx, data[pos:pos + size]
            pos += size

    def __iter__(self) -> Iterator[bytes]:
        for bucket in sorted(set(self._buffers) | set(self._files)):
            items = self._buffers.pop(bucket, [])
            f = self._files.pop(bucket, None)
            if f is not None:
                with f:
                    items = list(self._read(f)) + items
            items.sort(key=lambda item: item[0])  # stable: the first published copy wins
            previous = None
            for idx, raw in items:
                if idx == previous:
                    self.duplicates += 1
                    continue
                previous = idx
                yield raw

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()
        self._buffers.clear()


class SortedRows:
    """The rows of a job's results stream as dicts, ordered by idx (iterate once).

    Made by :func:`sorted_rows`, which reads the whole stream into the spill files first; that
    pass also notes every vector's width, so :attr:`vector` (the Parquet ``embedding`` type) is
    known before the first row is written.
    """

    def __init__(self, sorter: IdxSorter, stream: str, widths: VectorWidths):
        self._sorter, self._stream, self._widths = sorter, stream, widths

    @property
    def vector(self) -> pa.DataType | None:
        return self._widths.type

    def __iter__(self) -> Iterator[dict]:
        try:
            for raw in self._sorter:
                yield json.loads(raw)
            if self._sorter.duplicates:
                log.warning("%s: dropped %d duplicate rows", self._stream, self._sorter.duplicates)
        finally:
            self._sorter.close()


def sorted_rows(r: redis.Redis, stream: str, directory: str, total: int | None = None) -> SortedRows:
    """Read a job's results stream into spill files under ``directory``; its rows ordered by idx."""
    n = total if total is not None else r.xlen(stream)
    sorter = IdxSorter(directory, bucket_rows=max(BUCKET_ROWS, math.ceil(n / MAX_BUCKETS)))
    widths = VectorWidths()
    try:
        for entry_id, fields in iter_stream(r, stream):
            raw = fields.get(b"row")
            if raw is None:
                raise ValueError(f"{stream} entry {entry_id!r} has no 'row' field")
            row = json.loads(raw)
            idx = row.get("idx")
            if not isinstance(idx, int) or idx < 0:
                raise ValueError(f"{stream} entry {entry_id!r}: row has no valid idx ({idx!r})")
            widths.add(row)
            sorter.add(idx, raw)
    except BaseException:
        sorter.close()
        raise
    return SortedRows(sorter, stream, widths)


def _connection(redis_url: str | None, settings: Settings) -> redis.Redis:
    """``redis_url``, else the connection of the rq job running this, else the settings' URL."""
    from batchinfer.redis_conn import connect

    if redis_url:
        return connect(redis_url, settings.redis_ca_file)
    from rq import get_current_job

    job = get_current_job()
    if job is not None:
        return job.connection
    return connect(settings.redis_url, settings.redis_ca_file)


def _last_attempt() -> bool:
    """Whether this is the final try: outside rq, or an rq job with no retry left."""
    from rq import get_current_job

    job = get_current_job()
    return job is None or not job.retries_left


def export_job(job_id: str, *, prefix: str | None = None, output: str | None = None, fmt: str | None = None,
               redis_url: str | None = None) -> str:
    """Export job ``job_id``'s results and settle the job; returns where the file was written.

    ``output`` and ``fmt`` default to the job record's ``output`` / ``output_format`` and then to
    ``<results_root>/<job_id>.parquet``; the record's output must be a URI or stay inside
    ``results_root`` (:func:`confined_output`), while an ``output`` given here is the caller's own
    choice. Arguments are JSON values (this is an rq job function).
    """
    settings = Settings.from_env(prefix=prefix)
    r = _connection(redis_url, settings)
    keys = Keys(settings.prefix)
    try:
        record = JobStore(r, keys).get(job_id)
        if record is None:
            raise LookupError(f"job {job_id!r} does not exist under prefix {settings.prefix!r}")
        if record.status not in EXPORTABLE:
            raise RuntimeError(f"job {job_id} is {record.status}: not every request has its result yet")
        fmt = check_format(fmt or record.output_format or "parquet")
        requested = record.output
        if output is None and requested:  # the submitter's choice, read from Redis: confine it
            requested = confined_output(requested, settings.results_root)
        dest = resolve(output or requested or f"{job_id}{EXTENSIONS[fmt]}", settings.results_root)
        with tempfile.TemporaryDirectory(prefix="batchinfer-export-") as spill:
            rows = sorted_rows(r, keys.results(job_id), spill, record.total)
            location = write_rows(rows, dest, fmt, vector=rows.vector)
        final = scripts.register(r, "mark_exported")(
            keys=[keys.job(job_id), keys.cancelled, keys.results(job_id), keys.published(job_id),
                  keys.attempts(job_id)],
            args=[location, now_ms(), settings.results_ttl_seconds, job_id])
        log.info("job %s exported to %s (%s)", job_id, location, as_text(final),
                 extra={"job_id": job_id})
        return location
    except Exception as e:
        message = f"export failed: {type(e).__name__}: {e}"
        last = _last_attempt()
        with contextlib.suppress(redis.RedisError):
            scripts.register(r, "mark_export_failed")(keys=[keys.job(job_id)],
                                                      args=[message, now_ms(), "1" if last else "0"])
        log.error("job %s: %s%s", job_id, message, "" if last else " (will retry)", extra={"job_id": job_id})
        raise


def confined_output(output: str, results_root: str) -> str:
    """``output`` when it is a URI or a path inside ``results_root`` (relative paths are taken below it).

    A job's output comes from whoever submitted the job, so a plain path may not leave the exporter's
    results folder (``..``, absolute paths elsewhere, symlinks out); a URI (``file://``, ``s3://``, ...)
    is the explicit way to write elsewhere. Raises ValueError naming the folder.
    """
    if not isinstance(output, str) or not output.strip():
        raise ValueError(f"output must be a path or URI, got {output!r}")
    if "://" in output:
        return output
    root = os.path.realpath(results_root)
    path = os.path.realpath(os.path.join(root, output))  # an absolute output replaces root here
    if os.path.commonpath([root, path]) != root:
        raise ValueError(f"output {output!r} is outside the results folder {root} (BATCHINFER_RESULTS_ROOT): "
                         "give a path below it, or a URI (file:///..., s3://...) to write elsewhere")
    return output
