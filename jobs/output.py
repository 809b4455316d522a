"""Where result files go and how they get there: destinations, atomic writes, the formats.

A destination is a pyarrow filesystem URI (``file://``, ``s3://``, ``gs://``, ``hdfs://``, ...; ``s3://``
with the AWS environment, :func:`batchinfer.datasets.uris.filesystem_for`), an
absolute local path, or a relative path, which is taken below ``results_root`` and may not leave
it. Which destinations a *producer* may name for a job is :mod:`batchinfer.protocol.destinations`'
rule; what is resolved here is already someone's choice (the operator's, or a user's own file).
Files are written to a hidden temporary name next to the destination and renamed into place only
once complete, so a reader never sees a partial file; with ``replace=False`` a file already there
is never replaced. With an error file (OpenAI's two files), one pass over the rows writes both.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from batchinfer.datasets.uris import filesystem_for
from batchinfer.jobs.formats import LINE_FORMATS, RowGroups, check_format, result_schema, row_dict
from batchinfer.jobs.vectors import vector_type_of

ROW_GROUP_ROWS = 64 * 1024  # rows per Parquet row group at most
ROW_GROUP_BYTES = 32 << 20  # Arrow data per row group at most (rows with long outputs make smaller groups)
BATCH_ROWS = 1024  # rows converted from dicts to Arrow at once
_TEXT_BUFFER = 1 << 20


@dataclass(frozen=True)
class Destination:
    """A resolved output location: its filesystem, the path on it, and how to show it to users."""

    fs: pafs.FileSystem
    path: str
    location: str  # the URI given, or the absolute local path


def resolve(path_or_uri: str, results_root: str = ".") -> Destination:
    """Resolve a user's output location; ValueError naming the problem when it is not acceptable."""
    if not isinstance(path_or_uri, str) or not path_or_uri.strip():
        raise ValueError(f"output must be a path or URI, got {path_or_uri!r}")
    if "://" in path_or_uri:
        try:  # s3:// with the standard AWS environment (AWS_ENDPOINT_URL, ...): any S3-compatible store
            fs, path = filesystem_for(path_or_uri)
        except (ValueError, OSError, TypeError) as e:
            raise ValueError(f"output {path_or_uri!r}: unsupported or invalid URI ({e})") from None
        return Destination(fs, path, path_or_uri)
    if os.path.isabs(path_or_uri):
        path = os.path.normpath(path_or_uri)
    else:
        root = os.path.realpath(results_root)
        path = os.path.realpath(os.path.join(root, path_or_uri))
        if os.path.commonpath([root, path]) != root:
            raise ValueError(f"output {path_or_uri!r} leaves the results folder {root} "
                             "(give an absolute path or a URI to write elsewhere)")
    return Destination(pafs.LocalFileSystem(), path, path)


@contextlib.contextmanager
def atomic_output(dest: Destination, *, replace: bool = True) -> Iterator[Any]:
    """An output stream on a temporary name that becomes ``dest`` only if the block succeeds.

    ``replace=False``: a file already at ``dest`` is never replaced (:func:`place_new`).
    """
    parent, name = _split(dest.path)
    if parent:
        dest.fs.create_dir(parent, recursive=True)
    tmp_name = f".{name}.{uuid.uuid4().hex[:12]}.tmp"
    tmp = f"{parent.rstrip('/')}/{tmp_name}" if parent else tmp_name
    stream = dest.fs.open_output_stream(tmp)
    try:
        yield stream
        stream.close()
        if replace:
            dest.fs.move(tmp, dest.path)  # rename(2) on local disks: atomic
        else:
            place_new(dest, tmp)
    except BaseException:
        with contextlib.suppress(Exception):
            stream.close()
        with contextlib.suppress(Exception):
            dest.fs.delete_file(tmp)
        raise


def place_new(dest: Destination, tmp: str) -> None:
    """Move the complete file ``tmp`` to ``dest`` unless a file is there; ``FileExistsError`` if one is.

    A file that holds exactly ``tmp``'s bytes is kept and ``tmp`` dropped: that is an earlier run of
    the same write (an export whose job record could not be updated after its rename, retried), and
    keeping it changes nothing. On a local disk the final step is a hard link, which fails rather
    than replace a file that appeared meanwhile; elsewhere (object stores) it is a check, then the move.
    """
    if isinstance(dest.fs, pafs.LocalFileSystem):
        try:
            os.link(tmp, dest.path)
        except FileExistsError:
            pass
        except OSError:  # no hard links on this filesystem: check, then rename
            if _kind(dest.fs, dest.path) == pafs.FileType.NotFound:
                dest.fs.move(tmp, dest.path)
                return
        else:
            os.unlink(tmp)
            return
    elif _kind(dest.fs, dest.path) == pafs.FileType.NotFound:
        dest.fs.move(tmp, dest.path)
        return
    if _same_bytes(dest.fs, tmp, dest.path):
        dest.fs.delete_file(tmp)
        return
    raise FileExistsError(f"output {dest.location} already exists and was not written by this job: "
                          "it is not replaced (remove it, or name another output)")


def _kind(fs: pafs.FileSystem, path: str) -> pafs.FileType:
    return fs.get_file_info(path).type


def _same_bytes(fs: pafs.FileSystem, a: str, b: str) -> bool:
    """Whether ``a`` and ``b`` are files with the same bytes (read a chunk at a time)."""
    info_a, info_b = fs.get_file_info([a, b])
    if info_a.type != pafs.FileType.File or info_b.type != pafs.FileType.File or info_a.size != info_b.size:
        return False
    with fs.open_input_stream(a) as fa, fs.open_input_stream(b) as fb:
        while True:
            chunk = fa.read(_TEXT_BUFFER)
            if chunk != fb.read(_TEXT_BUFFER):
                return False
            if not chunk:
                return True


STALE_TEMPORARY_S = 3600  # a temporary file older than this belongs to a writer that died


def sweep_temporaries(dest: Destination, older_than_s: float = STALE_TEMPORARY_S) -> list[str]:
    """Delete the temporary files :func:`atomic_output` left next to ``dest`` (``.<name>.<id>.tmp``)
    when a writer died after its temporary file was complete: on an object store, between the upload
    and the move (a copy, then a delete), or during the move. Only those older than ``older_than_s``
    go, so a live writer's file is left to it. Returns the paths deleted."""
    import datetime as dt

    parent, name = _split(dest.path)
    selector = pafs.FileSelector(parent or ".", allow_not_found=True)
    cutoff = dt.datetime.now(dt.timezone.utc) - dt.timedelta(seconds=older_than_s)
    deleted = []
    for info in dest.fs.get_file_info(selector):
        mtime = info.mtime
        if (info.type == pafs.FileType.File and info.base_name.startswith(f".{name}.")
                and info.base_name.endswith(".tmp") and mtime is not None
                and (mtime if mtime.tzinfo else mtime.replace(tzinfo=dt.timezone.utc)) < cutoff):
            with contextlib.suppress(FileNotFoundError):
                dest.fs.delete_file(info.path)
                deleted.append(info.path)
    return deleted


def _split(path: str) -> tuple[str, str]:
    path = path.rstrip("/")
    if "/" not in path:
        return "", path
    parent, name = path.rsplit("/", 1)
    return (parent or "/"), name


def write_rows(rows: Iterable[Any], path_or_uri: str | Destination, fmt: str = "parquet", *,
               results_root: str = ".", row_group_rows: int = ROW_GROUP_ROWS,
               vector: pa.DataType | None | str = "auto", replace: bool = True,
               errors: str | Destination | None = None, kept_schema: pa.Schema | None = None) -> str:
    """Write result rows, in the order given, to a file; returns its location.

    ``rows`` are dicts, ``ResultRow`` objects or their JSON. Memory stays bounded by one row group per file
    (:data:`ROW_GROUP_ROWS` rows, :data:`ROW_GROUP_BYTES` of Arrow data) converted
    :data:`BATCH_ROWS` rows at a time, whatever the number of rows. ``fmt``: ``parquet``
    (``result_schema(vector)``), ``jsonl`` (the rows' JSON), ``openai`` (OpenAI batch output lines)
    or ``anthropic`` (Anthropic Message Batches result lines).

    ``errors``: a second file (same format, same Parquet schema) that gets every row that did not
    complete (``failed``, ``cancelled``, ``expired``), the first file holding the completed ones
    only: OpenAI's output and error files. Both are written in one pass, each atomically; an error
    file with no rows is written all the same (empty, or a Parquet file of no rows).

    ``vector``: the Parquet ``embedding`` column's type (None: no embedding columns), which must be
    fixed before the first row group is written. ``"auto"`` takes it from the first row group's
    rows: exact for files of one row group; a later row that does not fit it raises, so a caller
    streaming more rows passes the type it learnt from all of them (the export does).

    ``replace=False``: an existing file at the destination is not replaced (``FileExistsError``),
    unless it already holds exactly these bytes (:func:`place_new`).

    ``kept_schema``: the kept input columns a dataset job's rows carry (their
    :data:`batchinfer.jobs.formats.KEPT_KEY` dicts): Parquet files get them after the result columns,
    in these types; JSONL lines as extra keys, OpenAI / Anthropic lines as a ``metadata`` object.
    """
    check_format(fmt)
    dest = path_or_uri if isinstance(path_or_uri, Destination) else resolve(path_or_uri, results_root)
    error_dest = errors if errors is None or isinstance(errors, Destination) else resolve(errors,
                                                                                            results_root)
    dicts: Iterator[dict[str, Any]] = (row_dict(r) for r in rows)
    vector_type: pa.DataType | None = None
    if fmt == "parquet":
        if vector == "auto":  # holds the first row group's dicts; the export passes its type instead
            vector_type, dicts = _with_vector_type(dicts, row_group_rows)
        elif isinstance(vector, str):
            raise ValueError(f"vector must be a pyarrow type, None or 'auto', got {vector!r}")
        else:
            vector_type = vector
    with contextlib.ExitStack() as stack:  # closed in reverse: the error file is placed first
        sinks = [file_sink(fmt, stack.enter_context(atomic_output(d, replace=replace)), stack,
                           row_group_rows, vector_type, kept_schema)
                 for d in (dest, error_dest) if d is not None]
        ok, failed = sinks[0], sinks[-1]
        for row in dicts:
            (ok if row.get("status") == "completed" else failed).add(row)
        for sink in sinks:
            sink.finish()
    return dest.location


def file_sink(fmt: str, stream: Any, stack: contextlib.ExitStack, row_group_rows: int,
          vector: pa.DataType | None, kept: pa.Schema | None = None, *,
          row_group_bytes: int | None = None, batch_rows: int = BATCH_ROWS,
          text_buffer: int = _TEXT_BUFFER) -> _ParquetSink | _LineSink:
    """A file's writer, its Parquet writer (if any) closed with ``stack`` before its stream; the
    partitioned writer (:mod:`batchinfer.jobs.partitioned`) asks for smaller buffers."""
    if fmt != "parquet":
        return _LineSink(stream, LINE_FORMATS[fmt], text_buffer)
    writer = stack.enter_context(pq.ParquetWriter(stream, result_schema(vector, kept), compression="zstd"))
    groups = RowGroups(vector, row_group_rows=row_group_rows, batch_rows=batch_rows, kept=kept,
                       row_group_bytes=ROW_GROUP_BYTES if row_group_bytes is None else row_group_bytes)
    return _ParquetSink(writer, groups)


def _with_vector_type(rows: Iterator[dict[str, Any]],
                      row_group_rows: int) -> tuple[pa.DataType | None, Iterator[dict[str, Any]]]:
    """``vector="auto"``: the type of the first row group's rows, and every row (those held again)."""
    first = list(itertools.islice(rows, row_group_rows))
    return vector_type_of(first), itertools.chain(first, rows)


class _ParquetSink:
    """Rows into one Parquet file, a row group at a time."""

    def __init__(self, writer: pq.ParquetWriter, groups: RowGroups):
        self.writer, self.groups = writer, groups

    def add(self, row: dict[str, Any]) -> None:
        for table in self.groups.add(row):
            self.writer.write_table(table, row_group_size=self.groups.row_group_rows)

    @property
    def held_bytes(self) -> int:
        return self.groups.held_bytes

    def finish(self) -> None:
        """Write what is held (as a row group of its own: a flush)."""
        for table in self.groups.finish():
            self.writer.write_table(table, row_group_size=self.groups.row_group_rows)


class _LineSink:
    """Rows into one text file, a line each, written in chunks of about :data:`_TEXT_BUFFER`."""

    held_bytes = 0  # text is written in chunks of at most ``buffer`` characters, never held longer

    def __init__(self, stream: Any, line: Callable[[Mapping[str, Any]], str], buffer: int = _TEXT_BUFFER):
        self.stream, self.line, self.buffer = stream, line, buffer
        self.buf: list[str] = []
        self.size = 0

    def add(self, row: dict[str, Any]) -> None:
        text = self.line(row)
        self.buf.append(text)
        self.buf.append("\n")
        self.size += len(text) + 1
        if self.size >= self.buffer:
            self.finish()

    def finish(self) -> None:
        if self.buf:
            self.stream.write("".join(self.buf).encode())
        self.buf, self.size = [], 0
