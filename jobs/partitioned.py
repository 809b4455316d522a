"""Dataset jobs' outputs: the kept join, and result rows into a Hive-partitioned dataset with a manifest.

:func:`join_kept` gives each result row (in idx order) its kept input values from the job's kept
table (:class:`batchinfer.datasets.kept.KeptReader`). :func:`export_unit` writes a unit's rows as
files, then its manifest, then deletes what its previous manifest listed and this run did not write.

:func:`write_partitioned` routes every row to the partition its kept values name (``date=2026-12-03/``,
folder names formatted by pyarrow's Hive partitioning, a null as pyarrow's
``__HIVE_DEFAULT_PARTITION__``); the partition columns are in the path only, not in the files. A file's
name is fixed by its unit (``part-<unit>.parquet``), so a re-run of the unit replaces its files instead
of adding to them. Rows are first written to local spill files (one per partition, small buffers, at
most :data:`MAX_PARTITIONS` open, the Arrow data held over all of them bounded by ``memory_bytes``), and
only once every row is in are the files copied to the output root one at a time, each through
:func:`batchinfer.jobs.output.atomic_output` (a temporary name, then a move; on an object store the
object appears only complete). An error before that leaves nothing in the output; an error while
copying leaves the files copied so far complete, and the unit's manifest, written after them
(:mod:`batchinfer.datasets.manifest`), still the previous run's: a re-run completes it.
"""

from __future__ import annotations

import contextlib
import functools
import heapq
import io
import json
import logging
import operator
import os
import tempfile
import urllib.parse
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import pyarrow as pa
import pyarrow.dataset as pads
import pyarrow.parquet as pq

from batchinfer.datasets.kept import FILE_COLUMN, ROW_COLUMN, KeptReader
from batchinfer.datasets.manifest import (
    MANIFEST_DIR,
    InputSpan,
    Manifest,
    OutputFile,
    fingerprint,
    read_manifest,
    write_manifest,
)
from batchinfer.jobs.formats import EXTENSIONS, KEPT_KEY, check_format, protocol_row
from batchinfer.jobs.output import (
    ROW_GROUP_ROWS,
    Destination,
    atomic_output,
    file_sink,
    resolve,
    sweep_temporaries,
)
from batchinfer.protocol.rows import now_ms

__all__ = ["MAX_PARTITIONS", "SOURCE_KEY", "delete_stale", "export_unit", "join_kept", "manifest_rows",
           "write_partitioned"]

log = logging.getLogger(__name__)

MAX_PARTITIONS = 256  # partitions one job may write: each is an open spill file until the end
MEMORY_BYTES = 64 << 20  # Arrow data held over all partitions; past it the largest is flushed
GROUP_BYTES = 8 << 20  # a partition file's row group at most (many are filled at once)
BATCH_ROWS = 256  # rows of one partition converted to Arrow at once
TEXT_BUFFER = 64 << 10  # JSONL text held per partition
COPY_CHUNK = 4 << 20
KEPT_BATCH_ROWS = 8192  # kept rows turned into dicts at once
#: A row dict's key for where its input row was: ``(file index in the kept table's files, 1-based row
#: number in that file)``, from the kept table's ``__file`` / ``__row``; it makes the manifest's spans.
SOURCE_KEY = "__source"


def join_kept(rows: Iterable[dict], reader: KeptReader, total: int | None, *,
              source: bool = False) -> Iterator[dict]:
    """``rows`` (ordered by idx) each with its kept values under :data:`KEPT_KEY`: kept row ``i`` is
    request ``idx`` ``i``'s. ``source``: also each row's input position (``(file index, row number)``)
    under :data:`batchinfer.jobs.partitioned.SOURCE_KEY`, for the manifest. A kept table that does not
    hold one row per request (``total``; None: whatever it holds) is a ValueError."""
    expected = reader.rows if total is None else total
    if reader.rows != expected:
        raise ValueError(f"kept table {reader.location} has {reader.rows} rows, but the job has {expected} "
                         "requests: it does not belong to this job's submission")
    names = reader.schema.names
    batches = reader.batches(KEPT_BATCH_ROWS)
    held: list[dict[str, Any]] = []
    base = 0  # the idx of held[0]
    for row in rows:
        idx = row["idx"]
        if idx >= expected:
            raise ValueError(f"result row idx {idx} has no kept row (the kept table has {expected})")
        while idx >= base + len(held):
            base += len(held)
            batch = next(batches, None)
            if batch is None:
                raise ValueError(f"kept table {reader.location} ends before idx {idx}")
            held = batch.to_pylist()
        kept = held[idx - base]
        row[KEPT_KEY] = {name: kept[name] for name in names}
        if source:
            row[SOURCE_KEY] = (kept[FILE_COLUMN], kept[ROW_COLUMN])
        yield row


@dataclass
class _Partition:
    folder: str  # "date=2026-12-03/lang=en"
    local: str  # the spill file
    sink: Any  # jobs.output's Parquet or line sink
    rows: int = 0
    spans: dict[int, list[int]] = field(default_factory=dict)  # file index -> [rows, first, last]

    def count(self, source: Any) -> None:
        self.rows += 1
        if source is None:
            return
        index, number = source
        span = self.spans.get(index)
        if span is None:
            self.spans[index] = [1, number, number]
        else:
            span[0] += 1
            span[1], span[2] = min(span[1], number), max(span[2], number)

    def partition(self) -> dict[str, str]:
        """Key -> value text, as the path spells it (decoded)."""
        pairs = (segment.split("=", 1) for segment in self.folder.split("/"))
        return {urllib.parse.unquote(k): urllib.parse.unquote(v) for k, v in pairs}

    def inputs(self, locations: Sequence[str]) -> list[InputSpan]:
        return [InputSpan(locations[i] if 0 <= i < len(locations) else str(i), rows, first, last)
                for i, (rows, first, last) in sorted(self.spans.items())]


def _partition_fields(kept: pa.Schema, partition_by: Sequence[str]) -> list[pa.Field]:
    """The partition columns' fields (a dictionary type as its values' type); ValueError for a column
    that is not kept or whose type cannot be a folder name."""
    out = []
    for name in partition_by:
        if name not in kept.names:
            raise ValueError(f"partition column {name!r} is not a kept column "
                             f"({', '.join(kept.names) or 'none'})")
        f = kept.field(name)
        kind = f.type.value_type if pa.types.is_dictionary(f.type) else f.type
        if pa.types.is_nested(kind) or pa.types.is_binary(kind) or pa.types.is_large_binary(kind):
            raise ValueError(f"partition column {name!r} is of type {kind}: partition on a scalar column")
        out.append(pa.field(name, kind))
    return out


def _folder(partitioning: pads.Partitioning, fields: Sequence[pa.Field], values: tuple[Any, ...]) -> str:
    """The Hive folder of one combination of partition values, as pyarrow formats (and reads) it."""
    terms = [pads.field(f.name).is_null() if value is None else pads.field(f.name) == pa.scalar(value, f.type)
             for f, value in zip(fields, values, strict=True)]
    folder, _ = partitioning.format(functools.reduce(operator.and_, terms))
    return folder


def write_partitioned(rows: Iterable[dict[str, Any]], root: Destination, fmt: str, *,
                      partition_by: Sequence[str], kept_schema: pa.Schema, unit: str | None = None,
                      name: str | None = None, vector: pa.DataType | None = None,
                      inputs: Sequence[str] = (), spill_dir: str | None = None,
                      max_partitions: int = MAX_PARTITIONS,
                      memory_bytes: int = MEMORY_BYTES) -> list[OutputFile]:
    """Write ``rows`` (result row dicts with their :data:`KEPT_KEY` values and, for the manifest's
    spans, :data:`SOURCE_KEY`) below ``root`` as ``<folders>/<name><ext>``; returns the files written
    (paths relative to ``root``), in the order their partitions first appeared.

    ``fmt``: ``parquet`` (the result columns, then the kept columns but the partition columns, in
    their types) or ``jsonl``. ``name``: the files' name without extension, default ``part-<unit>``.
    ``kept_schema``: the kept columns (the partition columns among them); ``vector``: the Parquet
    embedding type (the export learns it while sorting). ``inputs``: the input files' locations by the
    kept table's file index. More than ``max_partitions`` partition values is a ValueError (nothing
    written). ``spill_dir``: where the spill files go (a temporary folder by default).
    """
    check_format(fmt)
    if fmt not in ("parquet", "jsonl"):
        raise ValueError(f"a partitioned output is parquet or jsonl, not {fmt}")
    if not partition_by:
        raise ValueError("partition_by names no column")
    if name is None:
        if unit is None:
            raise ValueError("write_partitioned needs a unit or a file name")
        name = f"part-{unit}"
    fields = _partition_fields(kept_schema, partition_by)
    partitioning = pads.partitioning(pa.schema(fields), flavor="hive")
    file_kept = pa.schema([f for f in kept_schema if f.name not in partition_by])
    ext = EXTENSIONS[fmt]
    parts: dict[tuple[Any, ...], _Partition] = {}
    with tempfile.TemporaryDirectory(prefix="batchinfer-partitions-", dir=spill_dir) as tmp:
        with contextlib.ExitStack() as stack:  # every spill file closed (its footer written) on leaving
            held = 0
            for row in rows:
                kept = row.get(KEPT_KEY) or {}
                values = tuple(kept.get(k) for k in partition_by)
                part = parts.get(values)
                if part is None:
                    if len(parts) >= max_partitions:
                        raise ValueError(f"the rows hold more than {max_partitions} values of partition_by "
                                         f"({', '.join(partition_by)}): partition on coarser columns")
                    local = os.path.join(tmp, f"{len(parts)}{ext}")
                    stream = stack.enter_context(open(local, "wb"))  # noqa: SIM115 - closed by the stack
                    sink = file_sink(fmt, stream, stack, ROW_GROUP_ROWS, vector, file_kept or None,
                                     row_group_bytes=GROUP_BYTES, batch_rows=BATCH_ROWS,
                                     text_buffer=TEXT_BUFFER)
                    part = parts[values] = _Partition(_folder(partitioning, fields, values), local, sink)
                out = {k: v for k, v in row.items() if k not in (KEPT_KEY, SOURCE_KEY)}
                if file_kept:
                    out[KEPT_KEY] = {n: kept.get(n) for n in file_kept.names}
                before = part.sink.held_bytes
                part.sink.add(out)
                held += part.sink.held_bytes - before
                part.count(row.get(SOURCE_KEY))
                if held > memory_bytes:  # flush the largest buffer as a row group of its own
                    largest = max(parts.values(), key=lambda p: p.sink.held_bytes)
                    held -= largest.sink.held_bytes
                    largest.sink.finish()
            for part in parts.values():
                part.sink.finish()
        outputs = []
        for part in parts.values():  # every row is in: place the files, one at a time
            relative = f"{part.folder}/{name}{ext}"
            dest = Destination(root.fs, f"{root.path.rstrip('/')}/{relative}",
                               f"{root.location.rstrip('/')}/{relative}")
            with open(part.local, "rb") as src, atomic_output(dest) as sink_stream:
                while chunk := src.read(COPY_CHUNK):
                    sink_stream.write(chunk)
            os.remove(part.local)
            sweep_temporaries(dest)  # what a writer of this file that died mid-move left behind
            outputs.append(OutputFile(relative, part.partition(), part.rows, part.inputs(inputs)))
    return outputs


def export_unit(rows: Iterable[dict[str, Any]], root: Destination, fmt: str, *, reader: KeptReader,
                partition_by: Sequence[str], unit: str, job_id: str, model: str | None,
                vector: pa.DataType | None = None, spill_dir: str | None = None) -> str:
    """Write a unit's joined rows (:func:`join_kept` with ``source``) as the dataset below ``root``,
    then its manifest (the kept table's ``meta`` names the input files), then delete what the unit's
    previous manifest listed and this run did not write; returns the manifest's location."""
    files = list(reader.meta.get("files") or [])
    outputs = write_partitioned(rows, root, fmt, partition_by=partition_by, kept_schema=reader.schema,
                                unit=unit, vector=vector, inputs=[f.get("location", "") for f in files],
                                spill_dir=spill_dir)
    previous = read_manifest(root.fs, root.path, unit)
    write_manifest(root.fs, root.path, Manifest(
        unit=unit, fingerprint=fingerprint(files), job_id=job_id, input=str(reader.meta.get("input") or ""),
        inputs=files, outputs=outputs, model=model, written_at=now_ms()))
    stale = delete_stale(root, previous, [out.path for out in outputs])
    if stale:
        log.info("job %s: deleted %d file(s) of unit %s's previous export", job_id, len(stale), unit,
                 extra={"job_id": job_id})
    return f"{root.location.rstrip('/')}/{MANIFEST_DIR}/{unit}.json"


def _inside(relative: str) -> bool:
    """Whether a manifest's output path stays below its root (a manifest is data, not trusted)."""
    parts = relative.split("/")
    return bool(relative) and not relative.startswith("/") and ".." not in parts and "" not in parts


def delete_stale(root: Destination, previous: Manifest | None, written: Iterable[str]) -> list[str]:
    """Delete the files ``previous`` (the unit's earlier manifest) listed that this export did not
    write again (``written``: paths relative to ``root``); returns the paths deleted. A path that
    would leave the root is ignored; a file already gone is no error."""
    if previous is None:
        return []
    keep = set(written)
    deleted = []
    for out in previous.outputs:
        if out.path in keep or not _inside(out.path):
            continue
        with contextlib.suppress(FileNotFoundError):
            root.fs.delete_file(f"{root.path.rstrip('/')}/{out.path}")
        deleted.append(out.path)
    return deleted


def manifest_rows(output: str, manifest: str, job_id: str | None = None) -> Iterator[dict[str, Any]]:
    """The rows of a partitioned export (the dataset root ``output``, the unit's manifest location),
    read back from the files the manifest lists and merged in ``idx`` order (each file is in it).

    Parquet rows come back as the protocol's dicts (:func:`batchinfer.jobs.formats.protocol_row`) with
    their kept columns; the partition columns are in the paths, not the rows. ``job_id``: a manifest
    that a later job of the same unit rewrote is a LookupError (its files hold that job's rows).
    """
    root, where = resolve(output), resolve(manifest)
    with where.fs.open_input_stream(where.path) as f:
        parsed = Manifest.from_json(f.read())
    if job_id is not None and parsed.job_id != job_id:
        raise LookupError(f"the output of job {job_id} was replaced by job {parsed.job_id}'s export of "
                          f"unit {parsed.unit}")
    files = [(f"{root.path.rstrip('/')}/{out.path}", out.path.endswith(".parquet")) for out in parsed.outputs
             if _inside(out.path)]
    streams = [_file_rows(root, path, parquet) for path, parquet in files]
    return heapq.merge(*streams, key=lambda row: row.get("idx") or 0)


def _file_rows(root: Destination, path: str, parquet: bool) -> Iterator[dict[str, Any]]:
    if parquet:
        pf = pq.ParquetFile(root.fs.open_input_file(path))
        for batch in pf.iter_batches():
            for rec in batch.to_pylist():
                yield protocol_row(rec)
        return
    with root.fs.open_input_stream(path) as stream:
        for line in io.BufferedReader(cast(io.RawIOBase, stream), buffer_size=1 << 20):
            if line.strip():
                yield json.loads(line)
