"""The kept table: input columns carried, with their types, from a dataset row to its result row.

While submitting, the client writes one row per request ``idx``, in ``idx`` order, holding the
``keep_columns`` (and ``partition_by`` columns) of the input row the request came from, plus
``__file`` (the index of its file in ``meta["files"]``) and ``__row`` (its 1-based row number in that
file). The exporter reads it back beside the results and joins by position (= ``idx``), so the
queue itself never carries these values: a Parquet file in the file store, at
:func:`kept_location`, is the whole mechanism. The job's ``meta`` (input root, unit, files, column
lists) rides in the file's schema metadata, so the manifest can say which input rows an output
covers.
"""

from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import Iterator, Mapping
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from batchinfer.datasets.uris import filesystem_for

__all__ = ["FILE_COLUMN", "META_KEY", "ROW_COLUMN", "KeptReader", "KeptWriter", "kept_location"]

FILE_COLUMN, ROW_COLUMN = "__file", "__row"
META_KEY = b"batchinfer.kept"
KEPT_VERSION = 1
_ROW_GROUP_ROWS = 65536  # rows buffered per row group: small scan batches would make tiny ones


def kept_location(files_root: str, job_id: str) -> str:
    """Where job ``job_id``'s kept table lives under the file store root (``Settings.files_root()``)."""
    return f"{files_root.rstrip('/')}/kept/{job_id}.parquet"


def _file_schema(schema: pa.Schema, meta: Mapping[str, Any]) -> pa.Schema:
    fields = [*schema, pa.field(FILE_COLUMN, pa.int32(), nullable=False),
              pa.field(ROW_COLUMN, pa.int64(), nullable=False)]
    payload = json.dumps({"version": KEPT_VERSION, **meta}, ensure_ascii=False, default=str)
    return pa.schema(fields, metadata={META_KEY: payload.encode()})


class KeptWriter:
    """Writes a job's kept table while its requests are sent: :meth:`add` per scanned batch, in the
    order the batch's rows become requests, then :meth:`close` (before the job's total is set, so
    no export can start on a half-written table) or :meth:`abort` (the submission failed).

    Rows go to a temporary name beside ``location`` (``<location>.<random>.tmp``) and only
    :meth:`close` moves the table into place: the client closes it only for a job it opened
    itself, so a second submission of the same job id (a nightly run racing another) that loses
    the open never touches the winner's table."""

    def __init__(self, location: str, schema: pa.Schema, meta: Mapping[str, Any]):
        """``schema``: the kept fields (names and types of the input's columns); ``meta``: the job's
        input description (``input``, ``unit``, ``files``, ``keep_columns``, ``partition_by``)."""
        clash = [name for name in (FILE_COLUMN, ROW_COLUMN) if name in schema.names]
        if clash:
            raise ValueError(f"kept columns must not be named {', '.join(clash)} (reserved)")
        self.location = location
        self.schema = schema
        self.rows = 0
        self._file_schema = _file_schema(schema, meta)
        self._fs, self._final = filesystem_for(location)
        self._path = f"{self._final}.{uuid.uuid4().hex[:12]}.tmp"  # this writer's own: see the class
        self._writer: pq.ParquetWriter | None = None
        self._pending: list[pa.RecordBatch] = []
        self._pending_rows = 0
        self._closed = False

    def add(self, batch: pa.RecordBatch, file_index: int, row_numbers: pa.Array) -> None:
        """The kept columns of ``batch`` (of one file, ``file_index`` in ``meta["files"]``), with
        each row's 1-based row number in that file."""
        if self._closed:
            raise ValueError(f"{self.location}: the kept table is closed")
        n = batch.num_rows
        if len(row_numbers) != n:
            raise ValueError(f"{n} kept rows but {len(row_numbers)} row numbers")
        if n == 0:
            return
        columns = [_conform(batch.column(field.name), field) for field in self.schema]
        columns.append(pa.repeat(pa.scalar(file_index, pa.int32()), n))
        columns.append(row_numbers.cast(pa.int64()))
        self._pending.append(pa.RecordBatch.from_arrays(columns, schema=self._file_schema))
        self._pending_rows += n
        self.rows += n
        if self._pending_rows >= _ROW_GROUP_ROWS:
            self._flush()

    def _flush(self) -> None:
        if self._writer is None:
            parent = self._path.rsplit("/", 1)[0]
            if parent and parent != self._path:
                self._fs.create_dir(parent, recursive=True)
            self._writer = pq.ParquetWriter(self._path, self._file_schema, filesystem=self._fs)
        if self._pending:
            self._writer.write_table(pa.Table.from_batches(self._pending, schema=self._file_schema),
                                     row_group_size=max(self._pending_rows, 1))
        self._pending, self._pending_rows = [], 0

    def close(self) -> str:
        """Write what is buffered and the footer, then move the table into place (replacing a table
        there); returns the location. A table of no rows is a file too. Call it only once the job
        is known to be this submission's own (opened by it)."""
        if not self._closed:
            self._flush()
            assert self._writer is not None
            self._closed = True  # once: a failed close leaves nothing (and abort nothing to do)
            try:
                self._writer.close()
                _move(self._fs, self._path, self._final)
            except BaseException:
                with contextlib.suppress(OSError):
                    self._fs.delete_file(self._path)
                raise
            finally:
                self._writer = None
        return self.location

    def abort(self) -> None:
        """Drop the table (a failed submission): close what is open and delete the temporary file,
        if any. The table at ``location`` is never touched: before :meth:`close` it is not this
        writer's (another submission's, or none); after it, it belongs to the job this submission
        opened, and goes with that job (``JobStore.delete(files_root=)``)."""
        if self._closed:
            return
        self._closed = True
        self._pending = []
        if self._writer is None:
            return
        try:
            self._writer.close()
        finally:
            self._writer = None
            with contextlib.suppress(OSError):  # nothing there to leave behind
                self._fs.delete_file(self._path)


def _move(fs: pafs.FileSystem, source: str, target: str) -> None:
    """Rename ``source`` over ``target`` (an object store: copy, then delete, where it has no move)."""
    try:
        fs.move(source, target)
    except NotImplementedError:
        fs.copy_file(source, target)
        fs.delete_file(source)


def _conform(column: pa.Array | pa.ChunkedArray, field: pa.Field) -> pa.Array:
    """``column`` as ``field``'s type (a Hive key read as a dictionary, say, kept as its declared type)."""
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    return column if column.type == field.type else column.cast(field.type)


class KeptReader:
    """Reads a job's kept table (exporter side): ``schema`` (the kept fields), ``meta``, ``rows``,
    and :meth:`batches` in ``idx`` order."""

    def __init__(self, location: str):
        self.location = location
        self._fs, self._path = filesystem_for(location)
        self._file = pq.ParquetFile(self._fs.open_input_file(self._path))
        arrow = self._file.schema_arrow
        raw = (arrow.metadata or {}).get(META_KEY)
        if raw is None:
            raise ValueError(f"{location}: not a kept table (no {META_KEY.decode()} metadata)")
        self.meta: dict[str, Any] = json.loads(raw)
        self.schema: pa.Schema = pa.schema([f for f in arrow if f.name not in (FILE_COLUMN, ROW_COLUMN)])
        self.rows: int = self._file.metadata.num_rows

    def batches(self, batch_rows: int = 65536) -> Iterator[pa.RecordBatch]:
        """The kept fields plus ``__file`` (int32) and ``__row`` (int64), in ``idx`` order."""
        yield from self._file.iter_batches(batch_size=batch_rows)

    def close(self) -> None:
        self._file.close()
