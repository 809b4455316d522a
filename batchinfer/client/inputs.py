"""Streamed readers of job inputs: JSONL (plain or OpenAI Batch lines), Parquet, records, DataFrames.

Readers yield :class:`InputLine` items one at a time, so a file of millions of lines is read in
constant memory. They do not validate request bodies (the scheduler does, once): they only turn
each line or row into a raw JSON body with its 1-based line number. A line that cannot even be
carried as a body (longer than the limit, not UTF-8) is yielded with an ``error`` instead of
stopping the read, and becomes an error row.

Anthropic Message Batches requests are lines ``{"custom_id", "params"}``, or Parquet rows of a
``custom_id`` and a ``params`` column (JSON text, or a struct whose null fields read as absent).

Embedding requests are lines or rows with ``input`` (a string, a list of strings, token ids or
lists of token ids) instead of a prompt; a table whose texts sit in another column (``text``)
names it with ``input_column``.

Datasets (a folder of Hive partitions, a glob, a URI, a pyarrow or polars table:
:class:`~batchinfer.datasets.source.DatasetSource`) are read by :func:`dataset_lines`: one line per
scanned row, its body rendered by a request template or taken from the request-field columns.
"""

from __future__ import annotations

import contextlib
import gzip
import itertools
import json
import stat
import sys
from array import array
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, NamedTuple

from batchinfer.datasets.errors import InputError  # the one class (no pyarrow): every reader raises it
from batchinfer.protocol.bodies import custom_id_of
from batchinfer.protocol.entries import REQUEST_FIELDS, RequestError
from batchinfer.workers.pooling_params import PoolingParams
from batchinfer.workers.sampling_params import SamplingParams

if TYPE_CHECKING:
    import pandas as pd
    import pyarrow as pa

    from batchinfer.datasets.kept import KeptWriter
    from batchinfer.datasets.source import DatasetFile, DatasetSource
    from batchinfer.datasets.templates import RequestTemplate

PARQUET_SUFFIXES = (".parquet", ".pq")
PARQUET_BATCH_ROWS = 4096
INPUT_COLUMNS = ("prompt", "prompt_token_ids", "messages", "input", "params")  # "input": embeddings
ANTHROPIC_COLUMNS = ("custom_id", "params")  # a table of Anthropic requests has these columns only
_READ_CHUNK = 1 << 20
# Integer fields: a pandas column with missing values turns them into floats (16.0), undone here.
_INT_COLUMNS = ("max_tokens", "max_completion_tokens", "min_tokens", "n", "top_k", "seed", "logprobs",
                "priority", "dimensions", "truncate_prompt_tokens")


class InputLine(NamedTuple):
    """One request-to-be: ``body`` (raw JSON text) or ``error``, at 1-based ``line``. A named tuple:
    a dataset yields millions of them, and a frozen dataclass costs several times more to make."""

    line: int
    body: str | None = None
    error: RequestError | None = None


def open_input(source: str | Path | IO[bytes] | Iterable[Any] | pd.DataFrame, *,
               max_line_bytes: int = 10 * 1024 * 1024, fmt: str | None = None,
               input_column: str | None = None) -> Iterator[InputLine]:
    """Dispatch on the kind of ``source``.

    A path (``"-"`` = stdin) is Parquet when it ends in ``.parquet``/``.pq`` or ``fmt="parquet"``,
    else JSONL (``.gz`` decompressed on the fly); a binary file object is JSONL; a pandas DataFrame
    is read like Parquet; any other iterable holds records (dicts or JSON strings).
    ``input_column``: for Parquet and DataFrames, the column read as each row's embedding ``input``.
    """
    if input_column is not None and not (isinstance(source, (str, Path)) or _is_dataframe(source)):
        raise InputError("input_column applies to Parquet files and DataFrames only")
    if isinstance(source, (str, Path)):
        name = str(source)
        if fmt == "parquet" or (fmt is None and name.lower().endswith(PARQUET_SUFFIXES)):
            return read_parquet(source, input_column=input_column)
        if input_column is not None:
            raise InputError(f"{name}: input_column applies to Parquet files only (a JSONL line names "
                             "its field 'input')")
        return read_jsonl(source, max_line_bytes=max_line_bytes)
    if hasattr(source, "read"):
        return read_jsonl(source, max_line_bytes=max_line_bytes)  # type: ignore[arg-type]
    if _is_dataframe(source):
        return read_dataframe(source, input_column=input_column)  # type: ignore[arg-type]
    return read_records(source, max_line_bytes=max_line_bytes)  # type: ignore[arg-type]


def input_name(source: Any) -> str:
    """A short name for the job record: the file name, ``<stdin>``, ``<dataframe>`` or ``<records>``."""
    if isinstance(source, (str, Path)):
        return "<stdin>" if str(source) == "-" else Path(source).name
    if hasattr(source, "read"):
        return getattr(source, "name", None) or "<stream>"
    return "<dataframe>" if _is_dataframe(source) else "<records>"


def _is_dataframe(obj: Any) -> bool:
    return type(obj).__name__ == "DataFrame" and hasattr(obj, "columns")


# -- JSONL -----------------------------------------------------------------------------------------


def read_jsonl(source: str | Path | IO[bytes], *,
               max_line_bytes: int = 10 * 1024 * 1024) -> Iterator[InputLine]:
    """Yield every non-blank line of a JSONL file as a raw body, with its 1-based line number.

    A missing file raises :class:`InputError` at once, before anything is read.
    """
    if not isinstance(source, (str, Path)):
        return _jsonl_lines(source, max_line_bytes)
    if str(source) == "-":
        return _jsonl_lines(sys.stdin.buffer, max_line_bytes)
    path = Path(source)
    try:  # checked and opened now, so that an unreadable file fails before a job exists
        if stat.S_ISDIR(path.stat().st_mode):
            raise InputError(f"{path}: is a folder, not a file")
        f = gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb")  # noqa: SIM115
    except FileNotFoundError:
        raise InputError(f"{path}: no such file") from None
    except OSError as e:
        raise InputError(f"{path}: cannot be read: {e.strerror or e}") from None
    return _jsonl_file(f, path, max_line_bytes)


def _jsonl_file(f: IO[bytes] | gzip.GzipFile, path: Path, max_line_bytes: int) -> Iterator[InputLine]:
    last = 0
    with f:
        try:
            for item in _jsonl_lines(f, max_line_bytes):
                last = item.line
                yield item
        except (OSError, EOFError) as e:  # a truncated or corrupt .gz, a failing disk
            raise InputError(f"{path}: read failed after line {last}: {e}") from None


def _jsonl_lines(f: IO[bytes] | gzip.GzipFile, max_line_bytes: int) -> Iterator[InputLine]:
    number = 0
    while True:
        raw = f.readline(max_line_bytes + 1)
        if not raw:
            return
        number += 1
        if len(raw) > max_line_bytes and not raw.endswith(b"\n"):
            size = len(raw) + _skip_to_newline(f)
            yield InputLine(number, error=RequestError(
                "line_too_long", f"line is {size} bytes, more than the limit of {max_line_bytes} bytes "
                f"(BATCHINFER_MAX_LINE_BYTES)", line=number))
            continue
        if number == 1 and raw.startswith(b"\xef\xbb\xbf"):
            raw = raw[3:]  # a UTF-8 byte order mark
        try:
            text = raw.decode("utf-8").strip()
        except UnicodeDecodeError as e:
            yield InputLine(number, error=RequestError("invalid_json", f"line is not UTF-8: {e}",
                                                       line=number))
            continue
        if text:
            yield InputLine(number, body=text)


def _skip_to_newline(f: IO[bytes] | gzip.GzipFile) -> int:
    """Consume the rest of an over-long line without holding it; returns the bytes skipped."""
    skipped = 0
    while True:
        chunk = f.readline(_READ_CHUNK)
        skipped += len(chunk)
        if not chunk or chunk.endswith(b"\n"):
            return skipped


# -- duplicate custom_ids ----------------------------------------------------------------------------


class DuplicateIds:
    """Finds the lines of one job that repeat a ``custom_id``, in bounded memory.

    Duplicates are accepted (each line still gets its own row, told apart by ``line`` and ``idx``)
    but reported, since ``custom_id`` is how callers match results. Each line costs 16 bytes (a
    64-bit hash of its id and its line number); the groups are found by one sort at the end. Two
    different ids with equal hashes (odds about n^2 / 2^65) would be reported as one.
    """

    def __init__(self) -> None:
        self._hashes = array("q")
        self._lines = array("q")

    def add(self, line: int, body: str) -> None:
        custom_id = custom_id_of(body)
        if custom_id is not None:
            self._hashes.append(hash(custom_id))
            self._lines.append(line)

    def groups(self) -> list[list[int]]:
        """Line numbers sharing one id, each group ascending, groups by their first line."""
        import numpy as np

        if len(self._hashes) < 2:
            return []
        hashes = np.frombuffer(self._hashes, dtype=np.int64)
        order = np.argsort(hashes, kind="stable")
        ordered = hashes[order]
        starts = np.flatnonzero(np.r_[True, ordered[1:] != ordered[:-1]])
        sizes = np.diff(np.r_[starts, len(ordered)])
        lines = np.frombuffer(self._lines, dtype=np.int64)[order]
        found = [sorted(lines[a:a + n].tolist()) for a, n in zip(starts, sizes, strict=True) if n > 1]
        return sorted(found)

    def warning(self, max_groups: int = 10, max_lines: int = 5) -> str | None:
        """One job-level warning naming the lines, or None when every custom_id is unique."""
        groups = self.groups()
        if not groups:
            return None
        shown = []
        for g in groups[:max_groups]:
            text = ", ".join(str(x) for x in g[:max_lines])
            shown.append(text + (f", ... ({len(g)} lines)" if len(g) > max_lines else ""))
        more = f"; and {len(groups) - max_groups} more group(s)" if len(groups) > max_groups else ""
        n = sum(len(g) for g in groups)
        return (f"warning: duplicate custom_id on {n} lines (accepted; each line has its own row, told "
                f"apart by line and idx): lines {'; lines '.join(shown)}{more}")


# -- records ---------------------------------------------------------------------------------------


def read_records(records: Iterable[Mapping[str, Any] | str | bytes], *,
                 max_line_bytes: int = 10 * 1024 * 1024) -> Iterator[InputLine]:
    """Yield Python records (dicts, or JSON text) as bodies; ``line`` is the 1-based position."""
    for number, record in enumerate(records, start=1):
        if isinstance(record, bytes):
            try:
                record = record.decode("utf-8")
            except UnicodeDecodeError as e:
                yield InputLine(number, error=RequestError("invalid_json", f"record is not UTF-8: {e}",
                                                           line=number))
                continue
        body = record if isinstance(record, str) else _json_body(record, number, "record")
        if isinstance(body, InputLine):  # not writable as JSON
            yield body
            continue
        if not body.isascii():
            try:
                body.encode("utf-8")
            except UnicodeEncodeError as e:  # a lone surrogate: Redis could not even carry it
                yield InputLine(number, error=RequestError("invalid_json", f"record is not Unicode: {e}",
                                                           line=number))
                continue
        if len(body) > max_line_bytes and len(body.encode("utf-8")) > max_line_bytes:
            yield InputLine(number, error=RequestError(
                "line_too_long", f"record is more than the limit of {max_line_bytes} bytes", line=number))
            continue
        yield InputLine(number, body=body)


def _json_body(record: Mapping[str, Any], number: int, what: str) -> str | InputLine:
    """``record`` as compact JSON text, or the error line to yield instead when ``what`` (a record,
    a row) holds a value JSON cannot carry."""
    try:
        return json.dumps(record, ensure_ascii=False, separators=(",", ":"), default=_json_default)
    except (TypeError, ValueError) as e:
        return InputLine(number, error=RequestError(
            "invalid_request", f"{what} cannot be written as JSON: {e}", line=number))


def _json_default(value: Any) -> Any:
    """numpy scalars and arrays, as found in DataFrame and Parquet rows."""
    if hasattr(value, "tolist"):
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


# -- Parquet and DataFrames ------------------------------------------------------------------------


def allowed_columns() -> frozenset[str]:
    """Columns a Parquet input may have: request fields, sampling and pooling parameters."""
    return (frozenset(REQUEST_FIELDS) | frozenset(SamplingParams.FIELDS) | {"max_completion_tokens", "input"}
            | frozenset(PoolingParams.FIELDS) | {"params"})


def check_columns(names: Iterable[str], where: str) -> None:
    """A Parquet input needs one prompt (or ``input``) column and no column that is not a request field."""
    names = list(names)
    if not any(c in names for c in INPUT_COLUMNS):
        raise InputError(f"{where}: needs a 'prompt', 'messages' or 'prompt_token_ids' column, or 'input' "
                         f"for embeddings, or 'params' for Anthropic requests (columns: "
                         f"{', '.join(names) or 'none'}; a table whose texts are in another column names it "
                         "with input_column)")
    if "params" in names:  # Anthropic Message Batches requests: the request is all in `params`
        others = [c for c in names if c not in ANTHROPIC_COLUMNS]
        if others:
            raise InputError(f"{where}: a 'params' column holds Anthropic requests, whose fields are all in "
                             f"it: the only other column is custom_id (found {', '.join(others)})")
        return
    unknown = [c for c in names if c not in allowed_columns()]
    if unknown:
        raise InputError(f"{where}: column(s) {', '.join(unknown)} are not request fields (allowed: "
                         f"{', '.join(sorted(allowed_columns()))})")


def _input_renames(names: list[str], input_column: str | None, where: str) -> dict[str, str]:
    """``{input_column: "input"}`` once the column is known to exist and not to clash."""
    if input_column is None or input_column == "input":
        return {}
    if input_column not in names:
        raise InputError(f"{where}: input_column {input_column!r} is not a column "
                         f"(columns: {', '.join(names) or 'none'})")
    if "input" in names:
        raise InputError(f"{where}: has an 'input' column already; input_column {input_column!r} "
                         "would be a second one")
    return {input_column: "input"}


def read_parquet(source: str | Path | IO[bytes], *, batch_rows: int = PARQUET_BATCH_ROWS,
                 input_column: str | None = None) -> Iterator[InputLine]:
    """Yield the rows of a Parquet file as bodies, one row group batch in memory at a time.

    ``line`` is the 1-based row number. Null cells are left out of the body, so optional columns
    work per row. A ``messages`` cell may be a list of structs or JSON text. An ``input`` cell
    (embeddings: string, list<string>, list<int> or list<list<int>>) becomes the body's
    ``input``, as does ``input_column``'s (e.g. ``"text"``). A missing file, a file that is not
    Parquet or a column that is not a request field raises :class:`InputError` at once.
    """
    import pyarrow.parquet as pq

    name = str(source) if isinstance(source, (str, Path)) else getattr(source, "name", "<parquet>")
    if isinstance(source, (str, Path)) and not Path(source).is_file():
        raise InputError(f"{source}: no such file")
    try:
        pf = pq.ParquetFile(source)
    except Exception as e:  # pyarrow raises ArrowInvalid / OSError variants for non-Parquet bytes
        raise InputError(f"{name}: not a readable Parquet file: {e}") from None
    names = pf.schema_arrow.names
    renames = _input_renames(names, input_column, name)
    check_columns([renames.get(c, c) for c in names], name)
    return _arrow_rows(pf.iter_batches(batch_size=batch_rows), renames)


def read_dataframe(df: pd.DataFrame, *, batch_rows: int = PARQUET_BATCH_ROWS,
                   input_column: str | None = None) -> Iterator[InputLine]:
    """Yield the rows of a pandas DataFrame like a Parquet file (``line`` = 1-based row)."""
    import pyarrow as pa

    names = [str(c) for c in df.columns]
    renames = _input_renames(names, input_column, "DataFrame")
    check_columns([renames.get(c, c) for c in names], "DataFrame")
    table = pa.Table.from_pandas(df, preserve_index=False)
    return _arrow_rows(table.to_batches(max_chunksize=batch_rows), renames)


def _arrow_rows(batches: Iterable[pa.RecordBatch],
                renames: Mapping[str, str] | None = None) -> Iterator[InputLine]:
    number = 0
    renames = renames or {}
    for batch in batches:
        columns = [renames.get(c, c) for c in batch.schema.names]
        values = [batch.column(i).to_pylist() for i in range(batch.num_columns)]
        for row in zip(*values, strict=True):
            number += 1
            body = _row_body(columns, row, number, "row")
            yield body if isinstance(body, InputLine) else InputLine(number, body=body)


def _row_body(columns: list[str], row: tuple[Any, ...], number: int, what: str) -> str | InputLine:
    """One table row as a request body's JSON text (nulls left out), or its error line."""
    record = {c: v for c, v in zip(columns, row, strict=True) if v is not None}
    for c in _INT_COLUMNS:
        v = record.get(c)
        if isinstance(v, float) and v.is_integer():
            record[c] = int(v)
    for name in ("messages", "params"):
        if isinstance(record.get(name), str):
            # left as text when it is not JSON: the scheduler reports the bad field
            with contextlib.suppress(ValueError):
                record[name] = json.loads(record[name])
    return _json_body(record, number, what)


# -- datasets ----------------------------------------------------------------------------------------

_GLOB_CHARS = ("*", "?", "[")


def is_dataset(source: Any) -> bool:
    """Whether ``source`` is read as a dataset (:class:`~batchinfer.datasets.source.DatasetSource`)
    whatever the options: a DatasetSource, a pyarrow Dataset or Table, a polars DataFrame, a folder,
    a glob, a URI (``s3://``, ``file://`` ...) or a list of paths. A single local file, stdin, a
    pandas DataFrame and records are read as before unless a dataset option (a template, kept
    columns, a filter) asks for the dataset reader."""
    module = type(source).__module__.split(".")[0]
    if module == "polars":
        return True
    if module == "pyarrow":  # loaded already, then
        import pyarrow as pa
        import pyarrow.dataset as pads

        return isinstance(source, (pa.Table, pa.RecordBatch, pads.Dataset))
    from batchinfer.datasets.source import DatasetSource

    if isinstance(source, DatasetSource):
        return True
    if isinstance(source, Path):
        return source.is_dir()
    if isinstance(source, str):
        return source != "-" and ("://" in source or any(c in source for c in _GLOB_CHARS)
                                  or Path(source).is_dir())
    if isinstance(source, (list, tuple)) and source:
        # a list of paths, not of records (dicts, or JSON objects as text)
        return all(isinstance(x, Path) or (isinstance(x, str) and not x.lstrip().startswith("{"))
                   for x in source)
    return False


def dataset_lines(source: DatasetSource, *, template: RequestTemplate | None = None,
                  keep: KeptWriter | None = None, keep_columns: Sequence[str] = (),
                  files: Sequence[DatasetFile] | None = None, input_column: str | None = None,
                  max_line_bytes: int = 10 * 1024 * 1024,
                  batch_rows: int = PARQUET_BATCH_ROWS) -> Iterator[InputLine]:
    """Yield exactly one :class:`InputLine` per scanned row of ``source``, files in ``files`` order
    (default ``source.files()``), rows in file order; ``line`` = the row's number in its file.

    Only the columns needed are read: ``template.columns`` (those the input has; a variable that is
    no column fails per row) or, without a template, the request-field columns (as a Parquet file's;
    ``input_column`` read as ``input``), plus ``keep_columns``. Kept columns that are not request
    fields stay out of the bodies; Hive partition keys neither kept nor request fields are not read.
    A row the template cannot render is an error row ``"<file> row <n>: <reason>"``. ``keep``
    receives each batch's ``keep_columns``, file index and row numbers before its rows are
    yielded, so the kept table's rows follow the requests' order.
    """
    from batchinfer.datasets.templates import RowError

    names = source.schema.names
    keep_set = set(keep_columns)
    missing = [c for c in keep_columns if c not in names]
    if missing:
        raise InputError(f"{source.name}: keep column(s) {', '.join(missing)} are not columns of the input "
                         f"(columns: {', '.join(names)})")
    renames: dict[str, str] = {}
    if template is not None:
        body_columns = [c for c in names if c in template.columns]
    else:
        renames = _input_renames(names, input_column, source.name)
        allowed, partition_keys = allowed_columns(), set(source.partition_keys)
        body_columns = [c for c in names if renames.get(c, c) in allowed
                        or (c not in keep_set and c not in partition_keys)]
        check_columns([renames.get(c, c) for c in body_columns], source.name)
    wanted = set(body_columns) | keep_set
    scan_columns = [c for c in names if c in wanted]
    files = list(source.files() if files is None else files)
    index = {f.location: i for i, f in enumerate(files)}
    fields = [renames.get(c, c) for c in body_columns]
    render = template.renderer(fields, all_columns=names) if template is not None else None
    for scanned in source.scan(scan_columns, batch_rows=batch_rows):
        batch, location = scanned.rows, scanned.file.location
        n = batch.num_rows
        if keep is not None:
            if location not in index:
                raise InputError(f"{location}: scanned a file that is not in the input's file list")
            keep.add(batch.select(list(keep_columns)), index[location], scanned.row_numbers)
        numbers: list[int] = scanned.row_numbers.to_pylist()  # type: ignore[assignment]  # never null
        values = [batch.column(c).to_pylist() for c in body_columns]
        rows = zip(*values, strict=True) if values else itertools.repeat((), n)
        pairs = zip(numbers, rows, strict=False)
        if render is not None:
            for number, row in pairs:
                try:
                    body = render(row)
                except RowError as e:
                    message = f"{location} row {number}: {e}"
                    yield InputLine(number, None, RequestError("invalid_request", message, line=number))
                    continue
                yield InputLine(number, body) if len(body) <= max_line_bytes else _sized(
                    body, number, location, max_line_bytes)
        else:
            for number, row in pairs:
                made = _row_body(fields, row, number, f"{location} row {number}")
                yield made if isinstance(made, InputLine) else _sized(made, number, location, max_line_bytes)


def _sized(body: str, number: int, location: str, max_line_bytes: int) -> InputLine:
    """``body``'s line, or a line_too_long error line when its UTF-8 is over the limit."""
    if len(body) > max_line_bytes and len(body.encode("utf-8")) > max_line_bytes:
        return InputLine(number, None, RequestError(
            "line_too_long", f"{location} row {number}: the request is more than the limit of "
            f"{max_line_bytes} bytes", line=number))
    return InputLine(number, body)


__all__ = ["DuplicateIds", "InputError", "InputLine", "check_columns", "dataset_lines", "input_name",
           "is_dataset", "open_input", "read_dataframe", "read_jsonl", "read_parquet", "read_records"]
