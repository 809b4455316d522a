"""Export a job's results stream to Parquet / JSONL / OpenAI or Anthropic batch lines (an rq job).

``export_job`` reads ``{bi}:results:<job>`` in chunks, orders the rows by ``idx`` with bounded
memory (an external merge sort: sorted runs spilled to temporary files, see :class:`IdxSorter`;
the same pass learns the embedding widths, which fix the Parquet schema before its first row
group), writes them a bounded row group at a time to a temporary name and renames it into
place (:mod:`batchinfer.jobs.output`); only then does the job record get its ``output`` and its
final status: ``finalizing`` -> ``completed``, ``cancelling`` -> ``cancelled``, ``expired``
stays. A job with an ``error_output`` gets OpenAI's two files from the same pass (the completed
rows in ``output``, the others there), and every export records the token sums over the rows
(``prompt_tokens``, ``completion_tokens``, ``cached_tokens``: OpenAI's batch ``usage``).
A failure is recorded on the job record (``errors``, ``export_error``) and raised, so rq retries
it; after the last retry the job is ``failed``.

A dataset job (``kept`` on its record) has a kept table of input columns, one row per ``idx``
(:class:`batchinfer.datasets.kept.KeptReader`), joined to the sorted rows as they stream
(:func:`join_kept`): the files get the kept columns. With ``partition_by`` the output is a dataset
root: :func:`batchinfer.jobs.partitioned.write_partitioned` writes one file per partition value,
then the unit's manifest is written (``_manifests/<unit>.json``), then the files the unit's previous
manifest listed and this export did not write are deleted; the record's ``output`` is the root and
its ``manifest`` the manifest's location.
"""

from __future__ import annotations

import contextlib
import heapq
import json
import logging
import os
import struct
import tempfile
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import pyarrow as pa
import redis

from batchinfer.config import Settings
from batchinfer.datasets.kept import KeptReader, kept_location
from batchinfer.jobs.formats import EXTENSIONS, RESULT_SCHEMA, check_format, result_schema
from batchinfer.jobs.output import resolve, write_rows
from batchinfer.jobs.partitioned import export_unit, join_kept
from batchinfer.jobs.queueing import (  # noqa: F401 - re-exported: the exporter's public API
    EXPORT_TIMEOUT_S,
    RETRY_INTERVALS,
    enqueue_export,
    rq_job_id,
)
from batchinfer.jobs.vectors import VectorWidths
from batchinfer.protocol.destinations import check_output
from batchinfer.protocol.rows import now_ms
from batchinfer.redis_conn import as_text
from batchinfer.store import replies, scripts
from batchinfer.store.jobstore import TERMINAL, JobStatus, JobStore

__all__ = ["RESULT_SCHEMA", "IdxSorter", "SortedRows", "enqueue_export", "export_job",
           "iter_stream", "rq_job_id", "sorted_rows", "write_rows"]

log = logging.getLogger(__name__)

STREAM_CHUNK = 1000  # entries per XRANGE at most
STREAM_BYTES = 1 << 20  # about this much row JSON per XRANGE reply (fewer entries when rows are large)
FIRST_CHUNK = 16  # entries of unknown size asked for at once
RUN_BYTES = 16 << 20  # rows' JSON (plus ROW_OVERHEAD each) held in memory before a sorted run is spilled
ROW_OVERHEAD = 128  # bytes a held row costs besides its JSON (its tuple, int and bytes objects)
MAX_RUNS = 64  # runs merged at once: open files, each with a READ_BUFFER
READ_BUFFER = 64 << 10
_RECORD = struct.Struct("<qI")  # spill record header: idx, length of the row's JSON

# statuses in which every request has its row: the export may run (again, for an ended job)
EXPORTABLE = frozenset({JobStatus.FINALIZING, JobStatus.CANCELLING, *TERMINAL})


def iter_stream(r: redis.Redis, key: str, *, count: int = STREAM_CHUNK, start: str = "-",
                end: str = "+", max_bytes: int | None = None) -> Iterator[tuple[bytes, dict[bytes, bytes]]]:
    """Every entry of stream ``key`` between ``start`` and ``end``, read ``count`` at a time.

    ``max_bytes``: read fewer when entries are large, so that one reply holds about that many
    bytes of field values (sized from the entries read so far; the first read asks for at most
    :data:`FIRST_CHUNK`).
    """
    want = count if max_bytes is None else min(count, FIRST_CHUNK)
    seen = seen_bytes = 0
    while True:
        entries = replies.entries(r.xrange(key, min=start, max=end, count=want))
        yield from entries
        if len(entries) < want:
            return
        start = "(" + as_text(entries[-1][0])
        if max_bytes is not None:
            seen += len(entries)
            seen_bytes += sum(len(v) for _, fields in entries for v in fields.values())
            want = max(1, min(count, max_bytes * seen // max(seen_bytes, 1)))


class IdxSorter:
    """Orders ``(idx, row JSON)`` pairs by idx in bounded memory; later duplicates of an idx are dropped.

    An external merge sort: rows are held until ``run_bytes`` (their JSON plus ``ROW_OVERHEAD``
    each) and then written, sorted, as a run file; iterating merges the runs, at most ``max_runs``
    at a time (more runs are first merged in consecutive groups into longer runs). Memory: one run
    being filled, or one row and one read buffer per merged run, whatever the number of rows.
    Every sort and merge is stable, and runs keep their arrival order, so the first copy of an idx
    added is the one kept.
    """

    def __init__(self, directory: str, run_bytes: int = RUN_BYTES, max_runs: int = MAX_RUNS,
                 read_buffer: int = READ_BUFFER):
        if max_runs < 2:
            raise ValueError(f"max_runs must be at least 2, got {max_runs}")
        self.directory = directory
        self.run_bytes = run_bytes
        self.max_runs = max_runs
        self.read_buffer = read_buffer
        self.duplicates = 0
        self.runs: list[str] = []  # spilled run files, in arrival order
        self._held: list[tuple[int, bytes]] = []
        self._held_bytes = 0
        self._names = 0

    def add(self, idx: int, raw: bytes) -> None:
        self._held.append((idx, raw))
        self._held_bytes += len(raw) + ROW_OVERHEAD
        if self._held_bytes >= self.run_bytes:
            self._spill()

    def _new_run(self) -> str:
        self._names += 1
        return os.path.join(self.directory, f"run-{self._names}.bin")

    def _spill(self) -> None:
        if self._held:
            self._held.sort(key=_idx)  # stable: arrival order among equal idx values
            self.runs.append(self._write_run(self._held))
        self._held, self._held_bytes = [], 0

    def _write_run(self, items: Iterable[tuple[int, bytes]]) -> str:
        path = self._new_run()
        with open(path, "wb", buffering=self.read_buffer) as f:
            for idx, raw in items:
                f.write(_RECORD.pack(idx, len(raw)))
                f.write(raw)
        return path

    def _read_run(self, path: str) -> Iterator[tuple[int, bytes]]:
        with open(path, "rb", buffering=self.read_buffer) as f:
            while header := f.read(_RECORD.size):
                idx, size = _RECORD.unpack(header)
                yield idx, f.read(size)

    def _merged(self, paths: list[str]) -> Iterator[tuple[int, bytes]]:
        # heapq.merge breaks ties by the iterable's position: an earlier run's copy comes first
        return heapq.merge(*(self._read_run(p) for p in paths), key=_idx)

    def __iter__(self) -> Iterator[bytes]:
        if self.runs:
            self._spill()
            while len(self.runs) > self.max_runs:  # one more pass over the data per level
                groups = [self.runs[i:i + self.max_runs] for i in range(0, len(self.runs), self.max_runs)]
                self.runs = []
                for group in groups:
                    if len(group) == 1:
                        self.runs.append(group[0])
                        continue
                    self.runs.append(self._write_run(self._merged(group)))
                    for path in group:
                        os.remove(path)
            items: Iterable[tuple[int, bytes]] = self._merged(self.runs)
        else:  # everything fitted in one run: no file
            self._held.sort(key=_idx)
            items, self._held = self._held, []
        previous = None
        for idx, raw in items:
            if idx == previous:
                self.duplicates += 1
                continue
            previous = idx
            yield raw
        self.close()

    def close(self) -> None:
        """Drop what is held and delete the run files."""
        self._held, self._held_bytes = [], 0
        for path in self.runs:
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)
        self.runs = []


def _idx(item: tuple[int, bytes]) -> int:
    return item[0]


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


def sorted_rows(r: redis.Redis, stream: str, directory: str, total: int | None = None, *,
                chunk_rows: int = STREAM_CHUNK, run_bytes: int = RUN_BYTES) -> SortedRows:
    """Read a job's results stream, ``chunk_rows`` entries per XRANGE, into sorted runs spilled under
    ``directory`` (:class:`IdxSorter`, ``run_bytes`` per run); its rows ordered by idx.

    ``total`` (the job's request count) is not needed: the sort's memory does not depend on it.
    """
    sorter = IdxSorter(directory, run_bytes=run_bytes)
    widths = VectorWidths()
    try:
        for entry_id, fields in iter_stream(r, stream, count=chunk_rows, max_bytes=STREAM_BYTES):
            raw = fields.get(b"row")
            if raw is None:
                raise ValueError(f"{stream} entry {entry_id!r} has no 'row' field")
            row = json.loads(raw)
            idx = row.get("idx")
            if not isinstance(idx, int) or isinstance(idx, bool) or not 0 <= idx < 1 << 63:
                raise ValueError(f"{stream} entry {entry_id!r}: row has no valid idx ({idx!r})")
            widths.add(row)
            sorter.add(idx, raw)
    except BaseException:
        sorter.close()
        raise
    return SortedRows(sorter, stream, widths)


class TokenSums:
    """The token counts of the rows passing through :meth:`counted`, summed (a row's missing or
    null count is 0): what the job record keeps as OpenAI's batch ``usage``."""

    FIELDS = ("prompt_tokens", "completion_tokens", "cached_tokens")

    def __init__(self) -> None:
        self.sums = dict.fromkeys(self.FIELDS, 0)

    def add(self, row: Mapping[str, Any]) -> None:
        for name in self.FIELDS:
            value = row.get(name)
            if isinstance(value, int) and not isinstance(value, bool):
                self.sums[name] += value

    def counted(self, rows: Iterable[dict]) -> Iterator[dict]:
        """``rows``, unchanged, each added on its way through."""
        for row in rows:
            self.add(row)
            yield row


def _connection(redis_url: str | None, settings: Settings) -> redis.Redis:
    """``redis_url``, else the connection of the rq job running this (when rq shares the data Redis:
    no ``rq_redis_url``), else the settings' Redis."""
    from batchinfer.redis_conn import connect

    if redis_url:
        return connect(redis_url, settings.redis_ca_file, cluster=settings.cluster())
    from rq import get_current_job

    job = get_current_job()
    if job is not None and not settings.rq_redis_url:
        return job.connection
    return settings.connect()


def _last_attempt() -> bool:
    """Whether this is the final try: outside rq, or an rq job with no retry left."""
    from rq import get_current_job

    job = get_current_job()
    return job is None or not job.retries_left


def _kept_reader(settings: Settings, job_id: str) -> KeptReader:
    location = kept_location(settings.files_root(), job_id)
    try:
        return KeptReader(location)
    except FileNotFoundError:
        raise FileNotFoundError(f"job {job_id}'s kept table {location} is missing") from None


def export_job(job_id: str, *, prefix: str | None = None, output: str | None = None, fmt: str | None = None,
               redis_url: str | None = None, chunk_rows: int = STREAM_CHUNK,
               run_bytes: int = RUN_BYTES) -> str:
    """Export job ``job_id``'s results and settle the job; returns where the file was written.

    ``output`` and ``fmt`` default to the job record's ``output`` / ``output_format`` and then to
    ``<results_root>/<job_id>.parquet``; the record's output, a producer's choice, must be a
    destination producers may name (:func:`batchinfer.protocol.destinations.check_output` against
    ``Settings.output_prefixes()``), and a file already there is replaced only by this job's own
    re-export; an ``output`` given here is the caller's own choice, written as given. With the
    record's output (no ``output`` given), the record's ``error_output`` (checked and replaced by
    the same rules) gets the rows that did not complete and the output the completed ones, written
    in one pass; the record then names both files written. The rows' token sums are recorded too.
    Arguments are JSON values (this is an rq job function).
    ``chunk_rows`` (entries per XRANGE) and ``run_bytes`` (rows held before a sorted run is
    spilled) bound the memory the export holds, with :data:`batchinfer.jobs.output.ROW_GROUP_BYTES`;
    the file does not depend on them.
    """
    settings = Settings.from_env(prefix=prefix)
    r = _connection(redis_url, settings)
    keys = settings.keys()
    try:
        store = JobStore(r, keys)
        record = store.get(job_id)
        if record is None:
            raise LookupError(f"job {job_id!r} does not exist under prefix {settings.prefix!r}")
        if record.status not in EXPORTABLE:
            raise RuntimeError(f"job {job_id} is {record.status}: not every request has its result yet")
        fmt = check_format(fmt or record.output_format or "parquet")
        allowed = settings.output_prefixes()
        requested = record.output
        if output is None and requested:  # the submitter's choice, read from Redis: check it again
            requested = check_output(requested, settings.results_root, allowed)
        dest = resolve(output or requested or f"{job_id}{EXTENSIONS[fmt]}", settings.results_root)
        errors = None
        if output is None and record.error_output:  # OpenAI's error file, the submitter's choice too
            errors = resolve(check_output(record.error_output, settings.results_root, allowed),
                             settings.results_root)
            if errors.location == dest.location:
                raise ValueError(f"error_output {errors.location} is the output itself")
        # never replace a file this job did not write: only its own earlier export (the record names it)
        replace = output is not None or (record.exported_at is not None and record.output == dest.location
                                          and (errors is None or record.error_output == errors.location))
        sums = TokenSums()
        if record.partition_by and not (record.kept and (output or requested) and errors is None):
            raise ValueError("a partitioned output needs a kept table and an output root, and takes no "
                             "error_output")
        reader = _kept_reader(settings, job_id) if record.kept else None
        with contextlib.ExitStack() as stack:
            spill = stack.enter_context(tempfile.TemporaryDirectory(prefix="batchinfer-export-"))
            if reader is not None:
                stack.callback(reader.close)
            rows = sorted_rows(r, keys.results(job_id), spill, chunk_rows=chunk_rows, run_bytes=run_bytes)
            counted: Iterable[dict] = sums.counted(rows)
            if reader is not None:
                result_schema(rows.vector, reader.schema)  # a kept name that clashes with a result column
                counted = join_kept(counted, reader, record.total, source=bool(record.partition_by))
            if record.partition_by and reader is not None:
                manifest = export_unit(counted, dest, fmt, reader=reader, partition_by=record.partition_by,
                                       unit=record.unit or reader.meta.get("unit") or job_id, job_id=job_id,
                                       model=record.model, vector=rows.vector, spill_dir=spill)
                store.set_manifest(job_id, manifest)
                location = dest.location
            else:
                location = write_rows(counted, dest, fmt, vector=rows.vector, replace=replace, errors=errors,
                                      kept_schema=reader.schema if reader is not None else None)
        final = scripts.register(r, "mark_exported")(
            keys=[keys.job(job_id), keys.for_job(job_id).cancelled, keys.results(job_id),
                  keys.published(job_id),
                  keys.attempts(job_id), keys.admitted(job_id)],
            args=[location, now_ms(), settings.results_ttl_seconds, job_id,
                  errors.location if errors is not None else "", *sums.sums.values()])
        log.info("job %s exported to %s%s (%s)", job_id, location,
                 f" and {errors.location}" if errors is not None else "", as_text(final),
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
