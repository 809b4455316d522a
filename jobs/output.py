"""Where result files go and how they get there: destinations, atomic writes, the three formats.

A destination is a pyarrow filesystem URI (``file://``, ``s3://``, ``gs://``, ``hdfs://``, ...), an
absolute local path, or a relative path, which is taken below ``results_root`` and may not leave
it (job records come from Redis, so a relative ``../..`` must not reach the exporter's disk).
Files are written to a hidden temporary name next to the destination and renamed into place only
once complete, so a reader never sees a partial file.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from batchinfer.jobs.formats import (
    arrow_table,
    check_format,
    jsonl_line,
    openai_line,
    result_schema,
    row_dict,
)
from batchinfer.jobs.vectors import vector_type_of

ROW_GROUP_ROWS = 64 * 1024  # rows per Parquet row group (and per conversion chunk)
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
        try:
            fs, path = pafs.FileSystem.from_uri(path_or_uri)
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
def atomic_output(dest: Destination) -> Iterator[Any]:
    """An output stream on a temporary name that becomes ``dest`` only if the block succeeds."""
    parent, name = _split(dest.path)
    if parent:
        dest.fs.create_dir(parent, recursive=True)
    tmp_name = f".{name}.{uuid.uuid4().hex[:12]}.tmp"
    tmp = f"{parent.rstrip('/')}/{tmp_name}" if parent else tmp_name
    stream = dest.fs.open_output_stream(tmp)
    try:
        yield stream
        stream.close()
        dest.fs.move(tmp, dest.path)  # rename(2) on local disks: atomic
    except BaseException:
        with contextlib.suppress(Exception):
            stream.close()
        with contextlib.suppress(Exception):
            dest.fs.delete_file(tmp)
        raise


def _split(path: str) -> tuple[str, str]:
    path = path.rstrip("/")
    if "/" not in path:
        return "", path
    parent, name = path.rsplit("/", 1)
    return (parent or "/"), name


def write_rows(rows: Iterable[Any], path_or_uri: str | Destination, fmt: str = "parquet", *,
               results_root: str = ".", row_group_rows: int = ROW_GROUP_ROWS,
               vector: pa.DataType | None | str = "auto") -> str:
    """Write result rows, in the order given, to a file; returns its location.

    ``rows`` are dicts, ``ResultRow`` objects or their JSON. Memory stays bounded by one row group,
    whatever the number of rows. ``fmt``: ``parquet`` (``result_schema(vector)``), ``jsonl`` (the
    rows' JSON) or ``openai`` (OpenAI batch output lines).

    ``vector``: the Parquet ``embedding`` column's type (None: no embedding columns), which must be
    fixed before the first row group is written. ``"auto"`` takes it from the first row group's
    rows: exact for files of one row group; a later row that does not fit it raises, so a caller
    streaming more rows passes the type it learnt from all of them (the export does).
    """
    check_format(fmt)
    dest = path_or_uri if isinstance(path_or_uri, Destination) else resolve(path_or_uri, results_root)
    with atomic_output(dest) as stream:
        if fmt == "parquet":
            _write_parquet(rows, stream, row_group_rows, vector)
        else:
            line = jsonl_line if fmt == "jsonl" else openai_line
            _write_lines((line(row_dict(r)) for r in rows), stream)
    return dest.location


def _chunks(rows: Iterable[Any], size: int) -> Iterator[list[dict]]:
    chunk: list[dict] = []
    for r in rows:
        chunk.append(row_dict(r))
        if len(chunk) >= size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def _write_parquet(rows: Iterable[Any], stream: Any, row_group_rows: int,
                   vector: pa.DataType | None | str) -> None:
    chunks = _chunks(rows, row_group_rows)
    first = next(chunks, [])
    if vector == "auto":
        vector = vector_type_of(first)
    elif isinstance(vector, str):
        raise ValueError(f"vector must be a pyarrow type, None or 'auto', got {vector!r}")
    with pq.ParquetWriter(stream, result_schema(vector), compression="zstd") as writer:
        for chunk in itertools.chain([first] if first else [], chunks):
            writer.write_table(arrow_table(chunk, vector), row_group_size=row_group_rows)


def _write_lines(lines: Iterable[str], stream: Any) -> None:
    buf: list[str] = []
    size = 0
    for text in lines:
        buf.append(text)
        buf.append("\n")
        size += len(text) + 1
        if size >= _TEXT_BUFFER:
            stream.write("".join(buf).encode())
            buf, size = [], 0
    if buf:
        stream.write("".join(buf).encode())
