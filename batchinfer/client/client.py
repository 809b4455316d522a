"""``Client``: the Python API of the queue (``from batchinfer import Client``); the CLI wraps it.

Submission streams the input into the intake stream in chunks (one Lua script call XADDs a
chunk's entries, each exactly as a producer's own XADD), without validating bodies: the
scheduler validates each one once and turns bad ones into error rows that carry their line
numbers. Only lines that cannot be carried at all (over the size limit, not UTF-8) are answered
here, through the same exactly-once publisher. A job is sent as any producer sends one
(docs/protocol.md, "Jobs"): ``op open``, its entries, ``op close``.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import json
import os
import time
import uuid
from collections.abc import Callable, Generator, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from batchinfer.config import Settings
from batchinfer.jobs.queueing import enqueue_export, finish_then_export, publish_then_export
from batchinfer.keys import Keys
from batchinfer.protocol.entries import PROTOCOL_VERSION, IntakeEntry, JobOp, parse_duration, valid_job_id
from batchinfer.protocol.rows import ResultRow, now_ms
from batchinfer.redis_conn import as_text, in_cluster, master_client
from batchinfer.store import replies, scripts
from batchinfer.store.jobcontrol import append_job_error, check_open, open_job
from batchinfer.store.jobstore import JobField, JobRecord, JobStatus, JobStore, new_job_id
from batchinfer.store.publish import Publisher, ReplicasBehind
from batchinfer.store.registry import Registry, WorkerInfo, check_partitions

if TYPE_CHECKING:
    import pandas as pd
    import pyarrow as pa
    import redis

    from batchinfer.client.inputs import InputLine
    from batchinfer.datasets.kept import KeptWriter
    from batchinfer.datasets.source import DatasetSource
    from batchinfer.datasets.templates import RequestTemplate

__all__ = ["Client", "JobNotFound", "ModelNotServed", "parse_duration"]

SUBMIT_CHUNK = 2000  # intake entries per round trip (one add_requests script call)
REPLICA_WAITS = 3  # BATCHINFER_REPLICA_ACK_TIMEOUT_MS periods a submit waits for its replicas
SUBMIT_CHUNK_BYTES = 8 * 1024 * 1024  # ... or fewer: so 2000 bodies of 10 MiB are never one call
READ_CHUNK = 5000  # result rows per XRANGE


class JobNotFound(KeyError):
    """No job with that id under this prefix."""

    def __str__(self) -> str:
        return f"no job {self.args[0]!r}"


class ModelNotServed(TimeoutError):
    """Direct requests timed out while held for a model no worker serves; the message says which,
    and what is served (e.g. ``1 request held: model 'SmolLM2' is not served; served: hf, qwen``)."""

    def __init__(self, message: str, held: dict[str, int], served: list[str]):
        super().__init__(message)
        self.held, self.served = held, served


class Client:
    """A connection to one batchinfer queue (a Redis URL and a key prefix)."""

    def __init__(self, url: str | None = None, settings: Settings | None = None, *,
                 connection: redis.Redis | None = None):
        """``connection``: an open connection to use instead of one made from the settings' URL
        (an rq job's, say)."""
        self.settings = settings or Settings.from_env()
        if url is not None:
            self.settings.redis_url = url
        self.redis = connection if connection is not None else self.settings.connect()
        self.keys = self.settings.keys()
        self.store = JobStore(self.redis, self.keys)
        self._publisher: Publisher | None = None
        self._partitions_checked = False

    @property
    def partitions_checked(self) -> bool:
        """Whether :meth:`check_partitions` found the count right already (no round trip left)."""
        return self._partitions_checked

    def check_partitions(self) -> None:
        """Once per client: its ``BATCHINFER_PARTITIONS`` is the deployment's (else
        :class:`~batchinfer.store.registry.PartitionsMismatch`, a ``ValueError``): requests sent
        under another count would go to streams no scheduler reads."""
        if not self._partitions_checked:
            check_partitions(self.redis, self.keys)
            self._partitions_checked = True

    @property
    def publisher(self) -> Publisher:
        if self._publisher is None:
            self._publisher = Publisher(self.redis, self.keys, replica_acks=self.settings.replica_acks,
                                        replica_timeout_ms=self.settings.replica_ack_timeout_ms)
        return self._publisher

    # -- jobs ------------------------------------------------------------------------------------

    def submit(self, source: str | Path | IO[bytes] | Iterable[Any] | pd.DataFrame | DatasetSource | Any,
               model: str | None = None, *, priority: int = 0, completion_window: str | int = "24h",
               metadata: Mapping[str, str] | None = None, output: str | None = None,
               output_format: str = "parquet", job_id: str | None = None, input_format: str | None = None,
               input_column: str | None = None, on_progress: Callable[[int], None] | None = None,
               error_output: str | None = None, tenant: str | None = None,
               template: RequestTemplate | None = None, keep_columns: Sequence[str] | None = None,
               partition_by: Sequence[str] | None = None, where: str | None = None,
               partitions: Sequence[str] = (), unit: str | None = None) -> str:
        """Create a job from ``source`` and stream its requests into the queue; returns the job id.

        ``source``: a JSONL or Parquet path (``"-"`` = stdin), a binary file, a pandas DataFrame,
        or an iterable of records (dicts or JSON strings); or a dataset (below). ``model`` applies to
        every line; lines naming another model are answered by it and counted (the record's
        ``models_overridden`` and ``overridden_models``). ``output`` is where the exporter writes the
        results (default ``<results_root>/<job>.parquet``): a path that stays inside ``results_root``,
        or a URI under one of ``output_uri_prefixes`` (:mod:`batchinfer.protocol.destinations`;
        ``ValueError`` otherwise).
        ``error_output`` (a destination by the same rule): OpenAI's error file, where the exporter
        writes the rows that did not complete, ``output`` then holding the completed ones only.
        ``tenant``: whose job it is; the scheduler's fair share puts a tenant's jobs in one group.
        ``input_column``: for Parquet, DataFrames and datasets, the column read as each row's
        embeddings ``input`` (e.g. ``"text"``). ``on_progress(n)`` is called with the number of
        requests sent so far after each chunk.

        Datasets: a :class:`~batchinfer.datasets.source.DatasetSource`, a pyarrow Dataset or Table, a
        polars DataFrame, a folder (Hive partitions discovered), a glob, a list of files or a URI
        (``s3://``, ``gs://``, ``file://``) is scanned in record batches (bounded memory); so is any
        ``source`` given with one of the options below. Every scanned row is one request (``line`` =
        its row number in its file).

        - ``template``: a :class:`~batchinfer.datasets.templates.RequestTemplate` rendering each
          row's request (a row it cannot render is an error row naming the file and row). A prompt
          template's ``prompt_as="auto"`` is resolved against ``model``'s registration: an embedding
          model takes ``input``, a model with a chat template ``messages``, another ``prompt``; a
          model no worker registered yet, ``messages``. Without a template the rows hold request
          fields, as a Parquet file's.
        - ``keep_columns``: input columns copied, with their types, into every result row (through
          a kept table in the file store); a name that is also a result column is refused.
        - ``partition_by``: kept columns (kept automatically) on which the output, a folder or URI
          given as ``output``, is written as a Hive-partitioned dataset with a manifest.
        - ``where`` (``"date = '2026-12-03'"``), ``partitions`` (``["date=2026-12-03"]``): row and
          partition filters. ``unit``: the unit of work the output's manifest names (default: from
          the input root and its files' paths).

        An empty or unreadable input raises :class:`~batchinfer.client.inputs.InputError` before any job
        exists. Lines that repeat a ``custom_id`` are sent, and one warning naming their line
        numbers goes to the job record's ``errors``. If submission is interrupted, the job is
        cancelled (what was sent is answered ``cancelled``) and the exception propagates.

        The job is sent as any producer sends one: ``op open``, its entries, ``op close``; the
        record and its total are also written at once (the same Lua scripts), so ``status`` reads
        the job, ``in_progress``, as soon as this returns. ``submitted`` counts what the scheduler
        has taken in.
        """
        # imported here: the readers load pyarrow, which status / cancel / the API never need
        from batchinfer.client.inputs import InputError, input_name, is_dataset, open_input

        window = parse_duration(completion_window)
        job_id = job_id or new_job_id()
        if not valid_job_id(job_id):
            raise ValueError(f"job id {job_id!r} is invalid (letters, digits, '.', '_', '-'; at most 128)")
        open_op = functools.partial(JobOp.open, job_id, model=model, completion_window=window,
                                    priority=priority, output=output, output_format=output_format,
                                    metadata=metadata, error_output=error_output, tenant=tenant)
        dataset = bool(template is not None or keep_columns or partition_by or where or partitions or unit
                       or is_dataset(source))
        # an output producers may not name is refused before anything is read or listed
        check_open(open_op(kept=bool(keep_columns or partition_by), partition_by=partition_by, unit=unit),
                   self.settings)
        kept: KeptWriter | None = None
        if dataset:
            name, lines, kept, extra = self._dataset_input(
                source, job_id, model, template=template, keep_columns=keep_columns or (),
                partition_by=partition_by or (), where=where, partitions=partitions, unit=unit,
                input_format=input_format, input_column=input_column)
        else:
            name, extra = input_name(source), {}
            lines = open_input(source,  # type: ignore[arg-type]  # not a dataset: a file, records, pandas
                               max_line_bytes=self.settings.max_line_bytes, fmt=input_format,
                               input_column=input_column)
        try:
            op = open_op(input_name=name, **extra)
            first = next(lines, None)  # an empty or unreadable input fails here, before a job exists
            if first is None:
                raise InputError(f"{name}: no requests (the input is empty)")
            self.check_partitions()  # the input reads; before anything is written
            # the record first, with the script the scheduler runs for `op open`: status reads it at once
            if not open_job(self.redis, self.keys, op, self.settings):
                raise ValueError(f"job {job_id} already exists")
        except BaseException:
            if kept is not None:
                with contextlib.suppress(Exception):  # the original error matters more
                    kept.abort()
            raise
        try:
            # the kept table is complete before `op close`: from then on an export may read it
            total = self._send(op, itertools.chain([first], lines), on_progress,
                               before_close=kept.close if kept is not None else None)
        except BaseException as e:
            if kept is not None:
                with contextlib.suppress(Exception):
                    kept.abort()
            with contextlib.suppress(Exception):  # the original error matters more
                append_job_error(self.redis, self.keys, job_id,
                                 f"submission interrupted: {type(e).__name__}: {e}")
                self.store.cancel(job_id)
            raise
        # The total at once too (the script the scheduler's close runs; the close then finds it set):
        # `status` shows the job in_progress with its total as soon as this returns.
        finish_then_export(self.publisher, job_id, total, self._enqueue_export)
        self._wait_for_replicas(job_id)
        return job_id

    def _wait_for_replicas(self, job_id: str) -> None:
        """With ``BATCHINFER_REPLICA_ACKS``: return only once the replicas have the submission (its
        last write, and so every one before it), so that a failover cannot lose it; up to
        ``REPLICA_WAITS`` timeouts, then :class:`~batchinfer.store.publish.ReplicasBehind`."""
        for attempt in range(REPLICA_WAITS):
            try:
                # the job's slot's master on a Cluster (its entries and record went there)
                self.publisher.wait_for_replicas(master_client(self.redis, self.keys.job(job_id)))
                return
            except ReplicasBehind as behind:
                if attempt == REPLICA_WAITS - 1:
                    raise ReplicasBehind(
                        behind.acked, behind.wanted, self.settings.replica_ack_timeout_ms * REPLICA_WAITS,
                        then=f"job {job_id} is submitted on the master, but a failover now could lose "
                             "it: check the replicas (batchinfer doctor), then the job's status") from None

    def _dataset_input(self, source: Any, job_id: str, model: str | None, *,
                       template: RequestTemplate | None, keep_columns: Sequence[str],
                       partition_by: Sequence[str], where: str | None, partitions: Sequence[str],
                       unit: str | None, input_format: str | None, input_column: str | None,
                       ) -> tuple[str, Iterator[InputLine], KeptWriter | None, dict[str, Any]]:
        """A dataset's input name, request lines, kept table writer (None when nothing is kept) and
        the ``op open`` parameters it adds (kept, partition_by, unit)."""
        import pyarrow as pa

        from batchinfer.client.inputs import InputError, dataset_lines
        from batchinfer.datasets.kept import KeptWriter, kept_location
        from batchinfer.datasets.manifest import unit_id
        from batchinfer.datasets.source import DatasetSource

        if isinstance(source, DatasetSource):
            if where or partitions or input_format:
                raise ValueError("where, partitions and input_format are the DatasetSource's own: give them "
                                 "to it")
            ds = source
        else:
            fmt = {"jsonl": "json"}.get(input_format or "", input_format)
            ds = DatasetSource(source, where=where, partitions=partitions, format=fmt)
        schema = ds.schema
        for what, names in (("partition_by", partition_by), ("keep", keep_columns)):
            unknown = [c for c in names if c not in schema.names]
            if unknown:
                raise InputError(f"{ds.name}: {what} column(s) {', '.join(unknown)} are not columns of the "
                                 f"input (columns: {', '.join(schema.names)})")
        kept_names = list(dict.fromkeys([*keep_columns, *partition_by]))
        _check_kept_names(kept_names)
        if template is not None and template.kind == "prompt" and template.prompt_as == "auto":
            template = template.with_prompt_as(self.prompt_as(model))
        files = ds.files()
        unit = unit or unit_id([ds.root, *sorted(f.relative for f in files)])
        kept = None
        if kept_names:
            meta = {"input": ds.root, "unit": unit, "keep_columns": list(keep_columns),
                    "partition_by": list(partition_by),
                    "files": [{"location": f.location, "relative": f.relative, "size": f.size}
                              for f in files]}
            kept = KeptWriter(kept_location(self.settings.files_root(), job_id),
                              pa.schema([schema.field(c) for c in kept_names]), meta)
        lines = dataset_lines(ds, template=template, keep=kept, keep_columns=kept_names, files=files,
                              input_column=input_column, max_line_bytes=self.settings.max_line_bytes)
        extra = {"kept": kept is not None, "partition_by": list(partition_by) or None, "unit": unit}
        return ds.name, lines, kept, extra

    def prompt_as(self, model: str | None) -> str:
        """How a prompt template's text reaches ``model`` ("auto" resolved against its registration):
        ``input`` for an embedding model, ``messages`` for a model with a chat template (or no
        registration yet: chat models are the common case), else ``prompt``."""
        info = Registry(self.redis, self.keys).get_model(model) if model else None
        if info is None:
            return "messages"
        if info.task == "embed":
            return "input"
        if "chat_template.jinja" in info.files:
            return "messages"
        try:
            config = json.loads(info.files.get("tokenizer_config.json", b"{}"))
        except ValueError:
            config = {}
        return "messages" if isinstance(config, dict) and config.get("chat_template") else "prompt"

    def _send(self, op: JobOp, lines: Iterator[InputLine], on_progress: Callable[[int], None] | None,
              before_close: Callable[[], object] | None = None) -> int:
        """The hot loop: ``op open``, the lines' entries in chunks (``SUBMIT_CHUNK`` entries or
        ``SUBMIT_CHUNK_BYTES`` of bodies, whichever comes first; one ``add_requests`` script call and
        round trip each), ``op close`` (``before_close()`` called just before it is sent)."""
        from batchinfer.client.inputs import DuplicateIds

        job_id, stream = op.job_id, self.keys.for_job(op.job_id).requests  # the job's partition
        limit = self.settings.max_requests_per_job
        # The script XADDs each entry as a producer would (same fields, same order); a chunk is four
        # arguments (its numbers as one text, its bodies as one string): redis-py then packs four
        # arguments, not a command per entry, which is what makes a large submit fast.
        add_requests = scripts.register(self.redis, "add_requests")
        if in_cluster(self.redis):  # a Cluster pipeline does not load its scripts (every master's)
            scripts.preload(add_requests)
        pipe = self.redis.pipeline(transaction=False)
        pipe.xadd(stream, replies.xadd_fields(op.to_fields()))  # a no-op for the scheduler: the job exists
        duplicates = DuplicateIds()
        bodies: list[bytes] = []
        numbers: list[int] = []  # idx, line and size in bytes of each body

        def add() -> None:  # queued on the pipeline; sent by its next execute
            add_requests(keys=[stream], client=pipe,
                         args=[PROTOCOL_VERSION, job_id, " ".join(map(str, numbers)), b"".join(bodies)])
            bodies.clear()
            numbers.clear()

        idx = size = 0
        for item in lines:
            if idx >= limit:
                raise ValueError(f"job has more than {limit} requests (BATCHINFER_MAX_REQUESTS_PER_JOB)")
            if item.error is not None:
                self._reject(job_id, idx, item)
            else:
                assert item.body is not None  # an InputLine holds a body or an error
                body = item.body.encode()  # as redis-py would encode it (UTF-8, strict)
                bodies.append(body)
                numbers += (idx, item.line, len(body))
                duplicates.add(item.line, item.body)
                size += len(body)
            idx += 1
            if len(bodies) >= SUBMIT_CHUNK or size >= SUBMIT_CHUNK_BYTES:
                add()
                pipe.execute()
                size = 0
                if on_progress:
                    on_progress(idx)
        warning = duplicates.warning()
        if warning:  # before the submission ends, so no export can race with it
            append_job_error(self.redis, self.keys, job_id, warning)
        if before_close is not None:
            before_close()
        if bodies:
            add()
        # the scheduler takes the close in after every entry above (stream order), then sets `total`
        pipe.xadd(stream, replies.xadd_fields(JobOp.close(job_id, idx).to_fields()))
        pipe.execute()
        if on_progress:
            on_progress(idx)
        return idx

    def _reject(self, job_id: str, idx: int, item: InputLine) -> None:
        """A line that cannot be sent becomes its error row at once."""
        err = item.error
        assert err is not None
        # As the scheduler's rows: the line number is the row's `line` column, not in the message.
        row = ResultRow.error(err.code, err.message, job_id=job_id, idx=idx, line=item.line)
        self.redis.hincrby(self.keys.job(job_id), JobField.SUBMITTED, 1)
        publish_then_export(self.publisher, [(row, None)], self._enqueue_export)

    def _enqueue_export(self, job_id: str) -> None:
        enqueue_export(self.redis, self.settings, job_id)

    def status(self, job_id: str) -> JobRecord:
        """The job's record; :class:`JobNotFound` when there is none."""
        record = self.store.get(job_id)
        if record is None:
            raise JobNotFound(job_id)
        return record

    def wait(self, job_id: str, *, timeout: float | None = None, poll_seconds: float = 0.5,
             progress: Callable[[JobRecord], None] | None = None) -> JobRecord:
        """Block until the job ends (completed, failed, expired, cancelled); ``TimeoutError`` after
        ``timeout`` seconds. ``progress(record)`` is called after every poll."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            record = self.status(job_id)
            if progress:
                progress(record)
            if record.terminal:
                return record
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"job {job_id} is still {record.status.value} after {timeout:g} s")
            time.sleep(poll_seconds)

    def cancel(self, job_id: str) -> JobStatus:
        """Ask for cancellation; returns the status after the call (unchanged for an ended job)."""
        status = self.store.cancel(job_id)
        if status is None:
            raise JobNotFound(job_id)
        return status

    def jobs(self, limit: int = 100) -> list[JobRecord]:
        """The newest jobs first."""
        return self.store.list(limit)

    def workers(self, model: str | None = None) -> list[WorkerInfo]:
        """Live workers (those whose heartbeat has not expired)."""
        return Registry(self.redis, self.keys).live_workers(model)

    # -- results ---------------------------------------------------------------------------------

    def result_rows(self, job_id: str) -> Iterator[dict[str, Any]]:
        """The job's result rows (docs/protocol.md dicts) in the order they were published.

        Read from the job's results stream; once that has expired, from the exported file.
        """
        record = self.status(job_id)
        key = self.keys.results(job_id)
        if self.redis.exists(key):
            start = "-"
            while True:
                entries = replies.entries(self.redis.xrange(key, min=start, max="+", count=READ_CHUNK))
                for _, fields in entries:
                    yield json.loads(fields[b"row"])
                if len(entries) < READ_CHUNK:
                    return
                start = "(" + entries[-1][0].decode()
        elif record.output and record.status == JobStatus.COMPLETED:
            yield from _exported_rows(record)

    def results_table(self, job_id: str) -> pa.Table:
        """The job's results as a pyarrow Table of the result schema, sorted by input order; a dataset
        job's kept input columns follow the result columns, with their types."""
        from batchinfer.jobs.formats import arrow_table

        record = self.status(job_id)
        rows = sorted(self.result_rows(job_id), key=lambda r: (r.get("idx") is None, r.get("idx") or 0))
        if record.kept:
            from batchinfer.datasets.kept import KeptReader, kept_location
            from batchinfer.jobs.partitioned import join_kept

            reader = KeptReader(kept_location(self.settings.files_root(), job_id))
            return arrow_table(join_kept(rows, reader, record.total), kept=reader.schema)
        return arrow_table(rows)

    def results(self, job_id: str) -> pd.DataFrame:
        """The job's results as a pandas DataFrame (one row per request, input order).

        Integer columns keep integer dtypes with missing values (pandas' nullable ``Int32`` /
        ``Int64``, and ``boolean``), rather than becoming float64 (``prompt_tokens 30.0``).
        """
        import pandas as pd
        import pyarrow as pa

        nullable = {pa.int8(): pd.Int8Dtype(), pa.int16(): pd.Int16Dtype(), pa.int32(): pd.Int32Dtype(),
                    pa.int64(): pd.Int64Dtype(), pa.bool_(): pd.BooleanDtype()}
        return self.results_table(job_id).to_pandas(types_mapper=nullable.get)

    def write_results(self, job_id: str, path_or_uri: str, fmt: str = "parquet",
                      on_row: Callable[[], None] | None = None, error_file: str | None = None) -> str:
        """Write the job's results, in input order, to a path or pyarrow filesystem URI.

        Returns the location written. Memory stays bounded: rows are sorted through spill files.
        ``on_row()`` is called for each row written (progress). ``error_file``: the rows that did
        not complete go to that file (same format) and ``path_or_uri`` holds the completed ones
        (OpenAI's output and error files). A dataset job's kept input columns are in every row, as
        in its export (one file, whatever its ``partition_by``).
        """
        import tempfile

        from batchinfer.jobs.export import sorted_rows
        from batchinfer.jobs.output import write_rows

        record = self.status(job_id)
        if "://" not in path_or_uri:
            path_or_uri = os.path.abspath(path_or_uri)  # the caller's cwd, not a results root
        if error_file is not None and "://" not in error_file:
            error_file = os.path.abspath(error_file)
        key = self.keys.results(job_id)
        if not self.redis.exists(key) and record.output and record.status == JobStatus.COMPLETED:
            from batchinfer.jobs.vectors import parquet_vector_type

            return write_rows(_counted(_exported_rows(record), on_row), path_or_uri, fmt,
                              vector="auto" if record.manifest else parquet_vector_type(record.output),
                              errors=error_file)
        with tempfile.TemporaryDirectory(prefix="batchinfer-results-") as spill:
            rows = sorted_rows(self.redis, key, spill, record.total)
            joined: Iterable[Any] = rows
            kept_schema = None
            if record.kept:  # the job's kept input columns, as its export writes them
                from batchinfer.datasets.kept import KeptReader, kept_location
                from batchinfer.jobs.partitioned import join_kept

                reader = KeptReader(kept_location(self.settings.files_root(), job_id))
                joined, kept_schema = join_kept(rows, reader, record.total), reader.schema
            return write_rows(_counted(joined, on_row), path_or_uri, fmt, vector=rows.vector,
                              errors=error_file, kept_schema=kept_schema)

    # -- direct requests -------------------------------------------------------------------------

    def request(self, body: Mapping[str, Any] | str, *, model: str | None = None, timeout: float = 600.0,
                client_request_id: str | None = None, hold_seconds: float | None = None) -> ResultRow:
        """Send one request without a job and wait for its row on a private ``reply_to`` stream.

        ``hold_seconds``: how long the scheduler holds it while no worker serves its model (default
        ``BATCHINFER_DIRECT_HOLD_SECONDS`` of the scheduler, 600 s; 0 = an ``unknown_model`` row at
        once). :class:`ModelNotServed` (a ``TimeoutError``) when ``timeout`` passes while its model
        is not served, else ``TimeoutError``.
        """
        rows = self.requests([body], model=model, timeout=timeout, hold_seconds=hold_seconds,
                             client_request_ids=[client_request_id] if client_request_id else None)
        try:
            return next(rows)
        finally:
            rows.close()  # deletes the reply stream now, not at garbage collection

    def requests(self, bodies: Iterable[Mapping[str, Any] | str], *, model: str | None = None,
                 timeout: float | None = 600.0, window: int = 1000,
                 client_request_ids: Iterable[str] | None = None,
                 hold_seconds: float | None = None) -> Generator[ResultRow, None, None]:
        """Send many direct requests; yield their rows as they arrive (not in input order).

        At most ``window`` requests are outstanding at once. ``row.custom_id`` (from the body) or
        ``row.request_id`` (the intake entry id) tells rows apart. ``hold_seconds`` as in
        :meth:`request`. When no row arrives for ``timeout`` seconds: :class:`ModelNotServed` if
        outstanding requests name a model no worker serves (held by the scheduler), else
        ``TimeoutError``.
        """
        if hold_seconds is not None and not hold_seconds >= 0:
            raise ValueError(f"hold_seconds must be >= 0, got {hold_seconds!r}")
        self.check_partitions()
        reply = self.keys.reply(uuid.uuid4().hex)  # same hash tag as every key
        ids = iter(client_request_ids) if client_request_ids is not None else None
        todo = iter(bodies)
        sent: dict[str, str] = {}  # request id (keys.direct_id of the entry id) -> body, while owed
        last: bytes | str = "0-0"
        exhausted = False
        try:
            while True:
                pipe = self.redis.pipeline(transaction=False)
                batch: list[tuple[Keys, str]] = []  # each entry's partition and body
                while not exhausted and len(sent) + len(batch) < window:
                    body = next(todo, None)
                    if body is None:
                        exhausted = True
                        break
                    entry = IntakeEntry(body=_direct_body(body, model), reply_to=reply,
                                        client_request_id=next(ids, None) if ids is not None else None,
                                        hold_seconds=hold_seconds)
                    part = self.keys.for_direct(entry.client_request_id)
                    pipe.xadd(part.requests, replies.xadd_fields(entry.to_fields()))
                    batch.append((part, entry.body))
                for entry_id, (part, text) in zip(pipe.execute(), batch, strict=True):
                    sent[part.direct_id(as_text(entry_id))] = text
                if not sent:
                    return
                block_ms = 0 if timeout is None else max(1, int(timeout * 1000))
                got = replies.read_streams(self.redis.xread({reply: last}, count=window, block=block_ms))
                if not got:
                    raise self._timeout(reply, timeout or 0.0, list(sent.values()))
                for entry_id, fields in got[0][1]:
                    last = entry_id
                    row = ResultRow.from_json(fields[b"row"])
                    if sent.pop(row.request_id, None) is None and sent:
                        sent.pop(next(iter(sent)))  # a row under another id (a retry's): one less owed
                    yield row
        finally:
            self.redis.delete(reply)

    def cancel_request(self, request_id: str) -> None:
        """Cancel the direct request ``request_id`` (its intake entry id, ``row.request_id``): a worker
        holding it ends it with a ``cancelled`` row (on its ``reply_to`` as usual), and the scheduler
        answers it so instead of dispatching it (docs/protocol.md, "Cancelling a direct request").
        A request that has its row already is left as it is."""
        self.redis.zadd(self.keys.cancelled_requests, {request_id: now_ms()})

    def _timeout(self, reply: str, timeout: float, bodies: list[str]) -> TimeoutError:
        """The error for requests still owed after ``timeout``: which models they wait for, if unserved."""
        from batchinfer.store.queue_state import served_models

        served = served_models(self.redis, self.keys)
        held: dict[str, int] = {}
        for body in bodies:
            name = _model_of(body)
            if name is not None and name not in served:
                held[name] = held.get(name, 0) + 1
        if not held:
            return TimeoutError(f"no result on {reply} within {timeout:g} s ({len(bodies)} request(s) "
                                "outstanding)")
        n = sum(held.values())
        names = ", ".join(f"{name!r}" for name in held)
        message = (f"{n} request{'s' if n != 1 else ''} held: model{'s' if len(held) != 1 else ''} {names} "
                   f"{'is' if len(held) == 1 else 'are'} not served; served: {', '.join(served) or 'none'}")
        return ModelNotServed(message, held, served)

    def close(self) -> None:
        self.redis.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _direct_body(body: Mapping[str, Any] | str, model: str | None) -> str:
    """A direct request's body as JSON text; ``model`` fills in a missing ``model`` field (of the
    request itself: an OpenAI Batch line's ``body``, an Anthropic line's ``params``)."""
    if model is None:
        return body if isinstance(body, str) else json.dumps(body, ensure_ascii=False, separators=(",", ":"))
    if isinstance(body, str):
        try:
            parsed = json.loads(body)
        except ValueError:
            return body  # sent as it is: the scheduler answers with an invalid_json row
        if not isinstance(parsed, dict):
            return body
    else:
        parsed = dict(body)
    request = _request_of(parsed)
    if request is not None and "model" not in request:
        request["model"] = model
    return json.dumps(parsed, ensure_ascii=False, separators=(",", ":"))


def _request_of(parsed: dict[str, Any]) -> dict[str, Any] | None:
    """The object holding a line's request fields (``model`` among them), copied into ``parsed``:
    the plain body itself, an OpenAI Batch line's ``body`` or an Anthropic line's ``params``."""
    for key in ("body", "params"):
        if key in parsed:
            inner = parsed[key]
            if not isinstance(inner, Mapping):
                return None  # the scheduler names the bad field
            parsed[key] = dict(inner)
            return parsed[key]
    return parsed


def _model_of(body: str) -> str | None:
    """The ``model`` a direct request's body names (plain, OpenAI Batch or Anthropic form), if any."""
    try:
        parsed = json.loads(body)
    except ValueError:
        return None
    if not isinstance(parsed, dict):
        return None
    request = _request_of(parsed)
    model = request.get("model") if request is not None else None
    return model if isinstance(model, str) else None


def _exported_rows(record: JobRecord) -> Iterator[dict[str, Any]]:
    """The rows of a job's exported Parquet file(s), in input order: with an ``error_output``, the
    output holds the completed rows and the error file the others, merged back by ``idx``."""
    import heapq

    if record.manifest:  # a partitioned export: the files its unit's manifest lists
        from batchinfer.jobs.partitioned import manifest_rows

        return manifest_rows(record.output or "", record.manifest, record.id)
    if not record.error_output:
        return _rows_from_parquet(record.output or "")
    return heapq.merge(_rows_from_parquet(record.output or ""), _rows_from_parquet(record.error_output),
                       key=lambda row: row.get("idx") or 0)


def _rows_from_parquet(location: str) -> Iterator[dict[str, Any]]:
    """Rows of an exported Parquet file, converted back to the protocol's dicts (ms timestamps)."""
    import pyarrow.parquet as pq

    from batchinfer.jobs.formats import protocol_row

    pf = pq.ParquetFile(location) if "://" not in location else _open_uri(location)
    for batch in pf.iter_batches():
        for row in batch.to_pylist():
            yield protocol_row(row)


def _open_uri(uri: str):
    import pyarrow.fs as pafs
    import pyarrow.parquet as pq

    fs, path = pafs.FileSystem.from_uri(uri)
    return pq.ParquetFile(fs.open_input_file(path))


def _check_kept_names(names: Sequence[str]) -> None:
    """Kept columns sit beside the result columns in every output (the Parquet columns, and a JSONL
    line's keys: every field a protocol row may have): a shared name is refused."""
    import dataclasses

    import pyarrow as pa

    from batchinfer.client.inputs import InputError
    from batchinfer.datasets.kept import FILE_COLUMN, ROW_COLUMN
    from batchinfer.jobs.formats import result_schema

    reserved = {*result_schema(pa.list_(pa.float32())).names,
                *(f.name for f in dataclasses.fields(ResultRow)), FILE_COLUMN, ROW_COLUMN}
    clash = [c for c in names if c in reserved]
    if clash:
        raise InputError(f"keep column(s) {', '.join(clash)} clash with result columns of the same name "
                         f"(result columns: {', '.join(sorted(reserved))})")


def _counted(rows: Iterable[Any], on_row: Callable[[], None] | None) -> Iterable[Any]:
    if on_row is None:
        return rows
    return (on_row() or row for row in rows)
