"""A tabular input, listed lazily and scanned one record batch at a time, each row with its number.

:class:`DatasetSource` takes a folder (Hive partitions ``key=value/`` discovered), a glob (``*`` and
``?`` within a folder, ``**`` across folders), a list of files, a URI (``s3://``, ``gs://``,
``file://``: :mod:`batchinfer.datasets.uris`), one Parquet / CSV / JSON-lines file, a pyarrow Dataset
or Table, or a pandas or polars DataFrame (data in memory reads as one file named ``<dataframe>`` or
``<table>``). How files are found, their formats told and hidden files skipped:
:mod:`batchinfer.datasets.listing`.

Filters: ``where`` (:class:`~batchinfer.datasets.filters.RowFilter`) and ``partitions``
(``["date=2026-12-03"]``) are ANDed; :meth:`DatasetSource.files` drops the files whose Hive partition
cannot match (``Dataset.get_fragments(filter=...)``), :meth:`DatasetSource.scan` filters rows batch by
batch. A row's number is its 1-based position in its file counted before any filter, so an error
or a kept row points at the same line whatever the filter.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds

from batchinfer.datasets.filters import RowFilter, partition_filter
from batchinfer.datasets.listing import (
    FORMATS,
    DatasetFile,
    InputError,
    Listing,
    is_glob,
    list_files,
    list_glob,
    list_location,
    list_pyarrow,
    unreadable,
)
from batchinfer.datasets.uris import store_error

__all__ = ["FORMATS", "DatasetFile", "DatasetSource", "InputError", "ScanBatch"]

_ROW = "__batchinfer_row__"  # the row-number column carried through a row filter
_SHOWN_PARTITIONS = 5
_FILE_SOURCES = (str, os.PathLike, list, tuple, ds.FileSystemDataset)


@dataclass(frozen=True)
class ScanBatch:
    """Rows of one file, after the row filter, with each row's number in that file."""

    file: DatasetFile
    rows: pa.RecordBatch  # the asked columns (partition columns too, when asked), AFTER the row filter
    row_numbers: pa.Array  # int64: each row's 1-based row number within its file (before filtering)


def _in_memory(source: Any) -> tuple[str, pa.Table | ds.Dataset] | None:
    """(name, data) for data already in memory; None for anything read from files."""
    if isinstance(source, pa.Table):
        return "<table>", source
    if isinstance(source, pa.RecordBatch):
        return "<table>", pa.Table.from_batches([source])
    if isinstance(source, ds.Dataset) and not isinstance(source, ds.FileSystemDataset):
        return "<table>", source
    module = type(source).__module__.split(".")[0]
    if module == "polars" and callable(getattr(source, "to_arrow", None)):
        return "<dataframe>", source.to_arrow()
    if module == "pandas" and hasattr(source, "columns"):
        return "<dataframe>", pa.Table.from_pandas(source, preserve_index=False)
    return None


class DatasetSource:
    """A tabular input: a folder (Hive partitions discovered), a glob (* ? **), a list of files, a
    URI (s3:// gs:// file://), one Parquet/CSV/JSON-lines file, a pyarrow Dataset or Table, a pandas
    or polars DataFrame. Listing is lazy; scanning holds one record batch at a time.

    ``format``: parquet | csv | json; None reads it from the files' suffixes (with ``format`` given, a
    folder's files without any suffix are read too). ``only``: restrict to these files (a nightly
    unit). Every failure to read the input as a whole is an :class:`InputError` with one sentence.
    """

    def __init__(self, source: Any, *, where: str | RowFilter | None = None,
                 partitions: Sequence[str] = (), format: str | None = None,
                 only: Sequence[DatasetFile] | None = None):
        if format is not None and format not in FORMATS:
            raise InputError(f"unknown format {format!r} (formats: {', '.join(FORMATS)})")
        try:
            self._where = RowFilter.parse(where) if isinstance(where, str) else where
            self._partitions = partition_filter(list(partitions))
        except ValueError as e:
            raise InputError(str(e)) from None
        self._filter: RowFilter | None = None  # where AND partitions
        for part in (self._where, self._partitions):
            if part is not None:
                self._filter = part if self._filter is None else self._filter & part
        self._source = source
        self._format = format
        self._only = None if only is None else frozenset(f.location for f in only)
        self._files: list[DatasetFile] | None = None
        self._memory = _in_memory(source)
        if self._memory is None and not isinstance(source, _FILE_SOURCES):
            raise InputError(f"cannot read a {type(source).__name__} as a dataset: give a path, a URI, a "
                             "list of files, a pyarrow Dataset or Table, or a pandas or polars DataFrame")

    def __repr__(self) -> str:
        return f"DatasetSource({self._source if self._memory is None else self._memory[0]!r})"

    # -- what it is ------------------------------------------------------------------------------

    @property
    def name(self) -> str:
        """Short name for the job record: the root's base name (a single file's name), "<dataframe>",
        "<table>"."""
        return self._memory[0] if self._memory else self._listing.name

    @property
    def root(self) -> str:
        """The dataset root location ("" for in-memory data): a folder, a glob's fixed prefix, the
        folder of a single file, the common folder of a list of files."""
        return "" if self._memory else self._listing.root

    @property
    def format(self) -> str | None:
        """parquet | csv | json; None for in-memory data."""
        return None if self._memory else self._listing.format

    @property
    def schema(self) -> pa.Schema:
        """Data columns, then the Hive partition columns."""
        return self._memory[1].schema if self._memory else self._dataset.schema

    @property
    def partition_keys(self) -> list[str]:
        """Hive keys in path order ([] when none)."""
        return [] if self._memory else list(self._listing.keys)

    def files(self) -> list[DatasetFile]:
        """Files the partition part of the filter keeps, sorted by location. InputError (store_error
        text) when the input cannot be listed; "... matches no file ..." when a filter was given and
        nothing matches."""
        if self._files is None:
            self._files = self._select()
        return list(self._files)

    def restricted(self, files: Sequence[DatasetFile]) -> DatasetSource:
        """The same source (filters, listing, schema shared) restricted to ``files``."""
        clone = copy.copy(self)
        clone._only, clone._files = frozenset(f.location for f in files), None
        return clone

    # -- scanning --------------------------------------------------------------------------------

    def scan(self, columns: Sequence[str] | None = None, batch_rows: int = 4096) -> Iterator[ScanBatch]:
        """The rows, files in :meth:`files` order, rows in file order, at most ``batch_rows`` per batch.
        ``columns``: None = every column. An unknown column, a bad filter, or a file unreadable as
        its format is an InputError (the first two raised here, before any row is read)."""
        if batch_rows < 1:
            raise ValueError("batch_rows must be at least 1")
        names = list(self.schema.names) if columns is None else list(columns)
        unknown = [c for c in names if self.schema.get_field_index(c) < 0]
        if unknown:
            raise InputError(f"{self.name} has no column {unknown[0]!r} "
                             f"(columns: {', '.join(self.schema.names)})")
        expression = self._expression
        needed = names + sorted(c for c in (self._filter.columns if self._filter else ()) if c not in names)
        files = self.files()
        return self._scan(files, names, needed, expression, batch_rows)

    def _scan(self, files: list[DatasetFile], names: list[str], needed: list[str],
              expression: pc.Expression | None, batch_rows: int) -> Iterator[ScanBatch]:
        ramp = pa.array(range(batch_rows), pa.int64())
        for file in files:
            batches, first = self._batches(file, needed, batch_rows), 1
            while True:
                try:
                    batch = next(batches)
                except StopIteration:
                    break
                except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError) as e:
                    raise InputError(unreadable(file.location, self.format, e)) from None
                except OSError as e:
                    raise InputError(store_error(e, file.location)) from None
                if batch.num_rows > len(ramp):
                    ramp = pa.array(range(batch.num_rows), pa.int64())
                numbers: pa.Array = pc.add(ramp.slice(0, batch.num_rows), first)
                first += batch.num_rows
                if expression is not None:
                    batch = batch.append_column(_ROW, numbers).filter(expression)
                    numbers = batch.column(_ROW)
                if len(numbers):
                    yield ScanBatch(file, batch.select(names), numbers)

    def _batches(self, file: DatasetFile, columns: list[str], batch_rows: int) -> Iterator[pa.RecordBatch]:
        # a generator: opening a file fails on the first next(), where _scan words the failure
        if self._memory:
            data = self._memory[1]
            if isinstance(data, pa.Table):
                yield from data.select(columns).to_batches(max_chunksize=batch_rows)
            else:
                yield from data.to_batches(columns=columns, batch_size=batch_rows)
            return
        # one file at a time, its batches streamed (pyarrow reads a few ahead): memory stays bounded
        fragment = self._fragments[self._listing.paths[file.location]]
        yield from fragment.to_batches(schema=self._dataset.schema, columns=columns, batch_size=batch_rows)

    # -- listing (lazy, cached; shared by restricted copies) ---------------------------------------

    @cached_property
    def _listing(self) -> Listing:
        source = self._source
        if isinstance(source, ds.FileSystemDataset):
            return list_pyarrow(source)
        if isinstance(source, (list, tuple)):
            return list_files([os.fspath(x) for x in source], self._format)
        text = os.fspath(source)
        return list_glob(text, self._format) if is_glob(text) else list_location(text, self._format)

    @property
    def _dataset(self) -> ds.FileSystemDataset:
        return self._listing.pyarrow_dataset()

    @cached_property
    def _fragments(self) -> dict[str, ds.Fragment]:
        return {f.path: f for f in self._dataset.get_fragments()}

    # -- filtering -------------------------------------------------------------------------------

    @cached_property
    def _expression(self) -> pc.Expression | None:
        if self._filter is None:
            return None
        try:
            return self._filter.expression(self.schema)
        except ValueError as e:
            raise InputError(str(e)) from None

    def _select(self) -> list[DatasetFile]:
        if self._memory:
            if self._partitions is not None:
                raise InputError(f"{self._memory[0]} has no Hive partitions to pick (--partition)")
            self._expression  # noqa: B018 - checks the filter's columns now, not at the first row
            return [DatasetFile(self._memory[0], self._memory[0], None, {})]
        listing, files = self._listing, self._listing.files
        if self._only is not None:
            files = [f for f in files if f.location in self._only]
            missing = sorted(self._only - {f.location for f in files})
            if missing:
                raise InputError(f"{missing[0]} is not (or no longer) a file of {listing.root}")
        if self._partitions is not None:
            odd = sorted(self._partitions.columns - set(listing.keys))
            if odd:
                keys = ", ".join(listing.keys) or "none"
                raise InputError(f"{odd[0]!r} is not a partition key of {listing.root} (keys: {keys})")
        row_filter, expression = self._filter, self._expression
        if row_filter is None or expression is None:
            return files
        if listing.keys:
            try:
                kept = {f.path for f in self._dataset.get_fragments(filter=expression)}
            except OSError as e:
                raise InputError(store_error(e, listing.root)) from None
            files = [f for f in files if listing.paths[f.location] in kept]
        if not files:
            raise InputError(f"the filter {row_filter.text} matches no file of {listing.root}"
                             f"{self._partition_summary(listing)}")
        return files

    @staticmethod
    def _partition_summary(listing: Listing) -> str:
        paths = ("/".join(f"{k}={v}" for k, v in f.partition.items()) for f in listing.files)
        seen = [p for p in dict.fromkeys(paths) if p]
        if not seen:
            return ""
        shown = ", ".join(seen[:_SHOWN_PARTITIONS])
        return f" (partitions: {shown}{f', ... {len(seen)} in all' if len(seen) > _SHOWN_PARTITIONS else ''})"
