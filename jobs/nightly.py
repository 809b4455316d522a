"""Nightly export of direct results (requests sent without a job) into a Hive-partitioned dataset.

``{bi}:results:direct`` holds the rows of requests that producers ``XADD``-ed without a job id.
Each night, after midnight UTC, :func:`nightly_export` (an rq job the exporter's scheduler runs)
writes every row of the finished days to ``<root>/date=YYYY-MM-DD/part-<from>-<to>.parquet`` (the
day of the row's stream id, UTC; ``from``/``to`` the ms range the run covered) and trims from the
stream the rows that are older than the results TTL.

The files are written by :func:`batchinfer.jobs.partitioned.write_partitioned` (partition column
``date``, each file atomic), and each run that wrote files records them in a manifest,
``_manifests/direct-<from>-<to>.json`` (:mod:`batchinfer.datasets.manifest`), as dataset jobs do.

The dataset is its own watermark: the largest ``to`` among its file names is where the next run
starts, so a run that failed half-way is simply repeated (same file names, atomic renames: no
duplicates) and nothing needs remembering in Redis. Each run schedules the next night first, so
the chain survives a failed run; :func:`schedule_nightly` is idempotent (one rq job id per night).

``date`` is a DATE partition (:data:`PARTITIONING`, date32): DuckDB and polars infer that type from
``date=YYYY-MM-DD``, while pyarrow's own Hive discovery infers a string, so read the dataset with
:func:`direct_dataset` / :func:`read_direct` (or pass ``partitioning=PARTITIONING`` to pyarrow).

Vectors of direct embedding requests are stored as ``list<float32>`` (:data:`DIRECT_FILE_SCHEMA`),
not the job files' ``fixed_size_list``: the partitions of different days must share one schema
whatever widths (or none) their rows had.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import itertools
import json
import logging
import re

import pyarrow as pa
import pyarrow.dataset as pads
import pyarrow.fs as pafs
import redis

from batchinfer.config import Settings
from batchinfer.datasets.manifest import Manifest, OutputFile, fingerprint, write_manifest
from batchinfer.jobs.export import RETRY_INTERVALS, _connection, iter_stream, rq_job_id
from batchinfer.jobs.formats import KEPT_KEY, result_schema
from batchinfer.jobs.output import Destination, resolve
from batchinfer.jobs.partitioned import write_partitioned
from batchinfer.jobs.vectors import VARIABLE_VECTOR
from batchinfer.keys import DIRECT, RQ_QUEUE
from batchinfer.protocol.rows import now_ms

log = logging.getLogger(__name__)

NIGHTLY_AT = dt.time(0, 10)  # UTC: a few minutes after midnight, when yesterday is complete
DAY_MS = 24 * 3600 * 1000
KEPT_GRACE_S = 24 * 3600  # a kept table without a job record is swept once this old
_PART = re.compile(r"^part-(\d+)-(\d+)\.parquet$")

#: The dataset's Hive partitioning: ``date=YYYY-MM-DD`` directories holding a DATE (date32) value.
PARTITIONING = pads.partitioning(pa.schema([pa.field("date", pa.date32())]), flavor="hive")
#: The columns of every file of the dataset: the job files' columns with the embedding columns
#: always present and always ``list<float32>`` (days of different widths, or none, share it).
DIRECT_FILE_SCHEMA = result_schema(VARIABLE_VECTOR)
#: The columns of a direct dataset read back: the files' columns, then the partition's ``date``.
#: Files written before the embedding columns existed read with those columns null.
DIRECT_SCHEMA = DIRECT_FILE_SCHEMA.append(pa.field("date", pa.date32()))
_DAY_SCHEMA = pa.schema([pa.field("date", pa.date32())])  # the partition value each row carries


def _day(entry_id: bytes) -> dt.date:
    ms = int(entry_id.split(b"-", 1)[0])
    return dt.datetime.fromtimestamp(ms / 1000, dt.timezone.utc).date()


def partition_dir(day: dt.date) -> str:
    """The folder of ``day``'s rows (``date=2025-01-31``), as :data:`PARTITIONING` writes and reads it."""
    folder, _ = PARTITIONING.format(pads.field("date") == pa.scalar(day, pa.date32()))
    return folder


def direct_dataset(root: str | None = None, *, prefix: str | None = None) -> pads.Dataset:
    """The nightly dataset at ``root`` (default ``<results_root>/direct``) with ``date`` a DATE.

    Files being written (hidden temporary names) are not part of it.
    """
    settings = Settings.from_env(prefix=prefix)
    base = resolve(root or "direct", settings.results_root)
    return pads.dataset(base.path, filesystem=base.fs, format="parquet", partitioning=PARTITIONING,
                        schema=DIRECT_SCHEMA)


def read_direct(root: str | None = None, *, prefix: str | None = None, columns: list[str] | None = None,
                filter: pads.Expression | None = None) -> pa.Table:
    """The rows of the nightly dataset (see :func:`direct_dataset`) as a table; ``filter`` on
    ``date`` reads only those days, e.g. ``pyarrow.dataset.field("date") >= datetime.date(2025, 1, 1)``.
    An empty or missing dataset gives an empty table of :data:`DIRECT_SCHEMA`."""
    try:
        dataset = direct_dataset(root, prefix=prefix)
    except FileNotFoundError:
        return DIRECT_SCHEMA.empty_table().select(columns or DIRECT_SCHEMA.names)
    return dataset.to_table(columns=columns, filter=filter)


def watermark(root: Destination) -> int:
    """ms up to which the dataset at ``root`` holds every direct row (0 for an empty dataset)."""
    selector = pafs.FileSelector(root.path, recursive=True, allow_not_found=True)
    ends = [int(m.group(2)) for info in root.fs.get_file_info(selector)
            if (m := _PART.match(info.base_name)) and info.type == pafs.FileType.File]
    return max(ends, default=0)


def start_of_day_ms(now: dt.datetime | None = None) -> int:
    """The last midnight (UTC) before ``now``, in ms since the epoch."""
    now = now or dt.datetime.now(dt.timezone.utc)
    midnight = dt.datetime.combine(now.astimezone(dt.timezone.utc).date(), dt.time(), dt.timezone.utc)
    return int(midnight.timestamp() * 1000)


def export_direct(*, prefix: str | None = None, root: str | None = None, until_ms: int | None = None,
                  redis_url: str | None = None) -> list[str]:
    """Write the direct rows published before ``until_ms`` (default: last midnight UTC); returns files.

    ``root`` (default ``<results_root>/direct``) is a local path or a pyarrow filesystem URI.
    """
    settings = Settings.from_env(prefix=prefix)
    r = _connection(redis_url, settings)
    keys = settings.keys()
    base = resolve(root or "direct", settings.results_root)
    start = watermark(base)
    server_s, server_us = r.time()
    # Rows published later get later stream ids: never look past the server's clock.
    cutoff = min(until_ms if until_ms is not None else start_of_day_ms(), server_s * 1000 + server_us // 1000)
    written: list[str] = []
    if cutoff > start:
        stream = keys.results(DIRECT)
        entries = iter_stream(r, stream, start=f"{start}-0", end=f"({cutoff}-0")
        outputs: list[OutputFile] = []
        # A day at a time (stream order is day order): one open file, however many days a late run covers.
        for day, group in itertools.groupby(entries, key=lambda e: _day(e[0])):
            rows = ({**json.loads(fields[b"row"]), KEPT_KEY: {"date": day}} for _, fields in group)
            outputs += write_partitioned(rows, base, "parquet", partition_by=["date"],
                                         kept_schema=_DAY_SCHEMA, name=f"part-{start}-{cutoff}",
                                         vector=VARIABLE_VECTOR)
        # An empty range writes nothing and the next run starts from the same place.
        if outputs:
            _write_run_manifest(base, stream, start, cutoff, outputs)
        written = [f"{base.location.rstrip('/')}/{out.path}" for out in outputs]
        keep_from = cutoff - settings.results_ttl_seconds * 1000
        if keep_from > 0:
            r.xtrim(stream, minid=f"{keep_from}-0", approximate=False)
    log.info("nightly export of direct results through %d: %d file(s)", cutoff, len(written))
    return written


def _write_run_manifest(base: Destination, stream: str, start: int, cutoff: int,
                        outputs: list[OutputFile]) -> None:
    """The manifest of one run: unit ``direct-<from>-<to>``, the stream's ms range as its input."""
    span = {"location": stream, "relative": f"{start}-{cutoff}", "size": sum(out.rows for out in outputs)}
    write_manifest(base.fs, base.path, Manifest(
        unit=f"{DIRECT}-{start}-{cutoff}", fingerprint=fingerprint([span]), job_id=DIRECT, input=stream,
        inputs=[span], outputs=outputs, model=None, written_at=now_ms()))


def sweep_kept_tables(r: redis.Redis, settings: Settings, *, older_than_s: int = KEPT_GRACE_S,
                      now: dt.datetime | None = None) -> list[str]:
    """Delete the kept tables (``<files_root>/kept/<job>.parquet``) of jobs whose record is gone:
    a record ends by its TTL in Redis, which cannot delete a file. A table younger than
    ``older_than_s`` stays (its job may be being submitted, its record not written yet).
    Returns the locations deleted."""
    from batchinfer.datasets.kept import kept_location
    from batchinfer.datasets.uris import filesystem_for

    keys = settings.keys()
    folder = kept_location(settings.files_root(), "x").rsplit("/", 1)[0]
    fs, path = filesystem_for(folder)
    cutoff = (now or dt.datetime.now(dt.timezone.utc)) - dt.timedelta(seconds=older_than_s)
    infos = [info for info in fs.get_file_info(pafs.FileSelector(path, allow_not_found=True))
             if info.type == pafs.FileType.File and info.base_name.endswith(".parquet")
             and not info.base_name.startswith(".") and info.mtime is not None
             and (info.mtime if info.mtime.tzinfo else info.mtime.replace(tzinfo=dt.timezone.utc)) < cutoff]
    deleted = []
    for info in infos:
        job_id = info.base_name[: -len(".parquet")]
        if not r.exists(keys.job(job_id)):
            with contextlib.suppress(FileNotFoundError):
                fs.delete_file(info.path)
                deleted.append(f"{folder}/{info.base_name}")
    if deleted:
        log.info("swept %d kept table(s) of jobs that no longer exist", len(deleted))
    return deleted


def nightly_export(*, prefix: str | None = None, root: str | None = None) -> list[str]:
    """The scheduled rq job: book tomorrow's run, export up to last midnight, then sweep the kept
    tables of jobs that no longer exist (:func:`sweep_kept_tables`)."""
    settings = Settings.from_env(prefix=prefix)
    from rq import get_current_job

    job = get_current_job()
    if job is not None:
        schedule_nightly(job.connection, settings, root=root)
    written = export_direct(prefix=settings.prefix, root=root)
    sweep_kept_tables(job.connection if job is not None else _connection(None, settings), settings)
    return written


def next_run(now: dt.datetime | None = None, at: dt.time = NIGHTLY_AT) -> dt.datetime:
    """The first ``at`` (UTC) strictly after ``now``."""
    now = (now or dt.datetime.now(dt.timezone.utc)).astimezone(dt.timezone.utc)
    when = dt.datetime.combine(now.date(), at, dt.timezone.utc)
    return when if when > now else when + dt.timedelta(days=1)


def schedule_nightly(r: redis.Redis, settings: Settings, *, when: dt.datetime | None = None,
                     root: str | None = None) -> str:
    """Schedule :func:`nightly_export` at ``when`` (default :func:`next_run`); returns the rq job id.

    Idempotent: the rq job id names the prefix and the night, and an existing one is kept.
    """
    from rq import Queue, Retry
    from rq.exceptions import DuplicateJobError
    from rq.serializers import JSONSerializer

    when = when or next_run()
    job_id = rq_job_id("nightly", settings.prefix, when.strftime("%Y-%m-%dT%H%M"))
    queue = Queue(RQ_QUEUE, connection=r, serializer=JSONSerializer)
    with contextlib.suppress(DuplicateJobError):  # this night is booked already
        queue.enqueue_at(when, "batchinfer.jobs.nightly.nightly_export",
                         kwargs={"prefix": settings.prefix, "root": root}, job_id=job_id, unique=True,
                         description=f"nightly direct export {when:%Y-%m-%d}",
                         retry=Retry(max=len(RETRY_INTERVALS), interval=list(RETRY_INTERVALS)),
                         job_timeout=6 * 3600, result_ttl=7 * 24 * 3600)
    return job_id
