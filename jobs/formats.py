"""Result rows as output records: the typed Parquet schema, JSONL lines, and the formats' line writers.

A result row arrives as the JSON object of docs/protocol.md (``row`` field of a results stream
entry). Everything here is pure: dict in, Arrow table or text line out. Embedding rows carry
their vectors as base64 float32 (``embeddings``); :mod:`batchinfer.jobs.vectors` turns them into
the Parquet array columns and back. The vendors' lines are their own modules:
:mod:`batchinfer.jobs.openai_lines` and :mod:`batchinfer.jobs.anthropic_lines`.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import pyarrow as pa

from batchinfer.jobs.anthropic_lines import anthropic_line
from batchinfer.jobs.openai_lines import KEPT_KEY, json_value, openai_line
from batchinfer.jobs.vectors import VECTOR_FIELDS, decoded_vectors, vector_arrays, vector_type_of
from batchinfer.protocol.rows import encode_vector

__all__ = ["EXTENSIONS", "FORMATS", "KEPT_KEY", "LINE_FORMATS", "LOGPROB_TYPE", "OUTPUT_TYPE",
           "RESULT_SCHEMA", "TOKEN_LOGPROB_TYPE", "TOOL_CALL_TYPE", "RowGroups", "anthropic_line",
           "arrow_record", "arrow_table", "check_format", "jsonl_line", "openai_line", "protocol_row",
           "result_schema", "row_dict"]

FORMATS = ("parquet", "jsonl", "openai", "anthropic")
EXTENSIONS = {"parquet": ".parquet", "jsonl": ".jsonl", "openai": ".jsonl", "anthropic": ".jsonl"}

_TS = pa.timestamp("ms", tz="UTC")
#: One token with its logprob: a top_logprobs element (``bytes``: the token's bytes, see docs/results.md).
TOKEN_LOGPROB_TYPE = pa.struct([
    pa.field("token_id", pa.int32()),
    pa.field("token", pa.string()),
    pa.field("bytes", pa.binary()),
    pa.field("logprob", pa.float32()),
])
#: One generated token's logprobs: the sampled token and the top-k of the step, best first.
LOGPROB_TYPE = pa.struct([*TOKEN_LOGPROB_TYPE, pa.field("top_logprobs", pa.list_(TOKEN_LOGPROB_TYPE))])
OUTPUT_TYPE = pa.struct([
    pa.field("index", pa.int32()),
    pa.field("text", pa.string()),
    pa.field("token_ids", pa.list_(pa.int32())),
    pa.field("finish_reason", pa.string()),
    pa.field("logprobs", pa.list_(LOGPROB_TYPE)),  # null when the request did not ask for logprobs
    pa.field("cumulative_logprob", pa.float64()),
    pa.field("structured", pa.string()),  # the constraint's kind; null when unconstrained
    pa.field("structured_complete", pa.bool_()),  # whether the text completes it; null when unconstrained
])

#: One tool call, in OpenAI's shape (``arguments``: the JSON text of the arguments object).
TOOL_CALL_TYPE = pa.struct([
    pa.field("id", pa.string()),
    pa.field("type", pa.string()),
    pa.field("function", pa.struct([pa.field("name", pa.string()), pa.field("arguments", pa.string())])),
])

#: The columns of every Parquet result file, in order. ``sampling_params`` and ``metadata`` are JSON
#: strings so that files of requests with different fields share one schema.
RESULT_SCHEMA = pa.schema((  # a tuple: pyarrow's stubs type a list of mixed fields as list[object]
    pa.field("job_id", pa.string()),
    pa.field("request_id", pa.string(), nullable=False),
    pa.field("idx", pa.int64()),
    pa.field("custom_id", pa.string()),
    pa.field("model", pa.string()),
    pa.field("status", pa.string(), nullable=False),
    pa.field("finish_reason", pa.string()),
    pa.field("output_text", pa.string()),
    pa.field("output_token_ids", pa.list_(pa.int32())),
    pa.field("outputs", pa.list_(OUTPUT_TYPE)),
    pa.field("prompt_tokens", pa.int32()),
    pa.field("completion_tokens", pa.int32()),
    pa.field("cached_tokens", pa.int32()),
    pa.field("error_code", pa.string()),
    pa.field("error_message", pa.string()),
    pa.field("line", pa.int64()),
    pa.field("created_at", _TS),
    pa.field("started_at", _TS),
    pa.field("finished_at", _TS),
    pa.field("worker", pa.string()),
    pa.field("sampling_params", pa.string()),
    pa.field("metadata", pa.string()),
    # Structured outputs (of the first completion): the constraint's kind, whether the output completed it.
    pa.field("structured", pa.string()),
    pa.field("structured_complete", pa.bool_()),
    # The first completion's tool calls; null when the request had no tools or made no call.
    pa.field("tool_calls", pa.list_(TOOL_CALL_TYPE)),
    # Predicted outputs, over all completions: the prediction's tokens kept and rejected; null without one.
    pa.field("accepted_prediction_tokens", pa.int32()),
    pa.field("rejected_prediction_tokens", pa.int32()),
))

_JSON_COLUMNS = ("sampling_params", "metadata", "pooling_params")
_OUTPUT_KEYS = ("index", "text", "token_ids", "finish_reason", "cumulative_logprob", "structured",
                "structured_complete")
_TOKEN_KEYS = ("token_id", "token", "logprob")
_FIRST_BATCH_ROWS = 8  # rows of unknown size converted at once; later batches are sized from them


def result_schema(vector: pa.DataType | None = None, kept: pa.Schema | None = None) -> pa.Schema:
    """The Parquet schema of a file whose vectors are of type ``vector`` (None: no embedding rows),
    followed by the ``kept`` input columns with their own types (a dataset job's; None: none).

    Without embedding rows it is :data:`RESULT_SCHEMA` itself (generation files are unchanged);
    with them three columns follow it: ``pooling_params`` (JSON text), ``embedding`` (the row's
    first vector, ``vector``: ``fixed_size_list<float32>[dim]`` when every vector of the file has
    one width, else ``list<float32>``) and ``embeddings`` (``list<vector>``: every vector of a row
    that has more than one, i.e. a list ``input``; null otherwise).
    """
    schema = RESULT_SCHEMA if vector is None else pa.schema((
        *RESULT_SCHEMA, pa.field("pooling_params", pa.string()), pa.field("embedding", vector),
        pa.field("embeddings", pa.list_(vector))))
    if kept:
        clash = sorted(set(kept.names) & set(schema.names))
        if clash:
            raise ValueError(f"kept column(s) {', '.join(clash)} clash with result columns")
        schema = pa.schema((*schema, *kept))
    return schema


def check_format(fmt: str) -> str:
    """``fmt`` if it is one of :data:`FORMATS`, else a ValueError naming the choices."""
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    return fmt


def row_dict(row: Any) -> dict[str, Any]:
    """A result row as a plain dict: a dict, a ``ResultRow`` (``to_dict`` / dataclass) or its JSON."""
    if isinstance(row, Mapping):
        return dict(row)
    if isinstance(row, (str, bytes, bytearray)):
        value = json.loads(row)
        if not isinstance(value, dict):
            raise ValueError(f"a result row must be a JSON object, got {type(value).__name__}")
        return value
    if hasattr(row, "to_dict"):
        return dict(row.to_dict())
    if dataclasses.is_dataclass(row) and not isinstance(row, type):
        return dataclasses.asdict(row)
    raise TypeError(f"cannot read a result row from {type(row).__name__}")


def _json_text(value: Any) -> str | None:
    if value is None or isinstance(value, str):
        return value
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def arrow_record(row: Mapping[str, Any], schema: pa.Schema = RESULT_SCHEMA) -> dict[str, Any]:
    """One row's values for ``schema`` but its vector columns (unknown keys dropped, JSON columns
    as text); :func:`arrow_table` adds the vectors."""
    rec = {name: row.get(name) for name in schema.names if name not in VECTOR_FIELDS}
    for name in _JSON_COLUMNS:
        if name in rec:
            rec[name] = _json_text(rec[name])
    outs = rec["outputs"]
    if outs is not None:
        rec["outputs"] = [{**{k: o.get(k) for k in _OUTPUT_KEYS},
                           "logprobs": _arrow_logprobs(o.get("logprobs"))} for o in outs]
    if "tool_calls" in rec:
        rec["tool_calls"] = _arrow_calls(rec["tool_calls"])
    return rec


def _arrow_calls(calls: Any) -> list[dict[str, Any]] | None:
    """Tool calls for :data:`TOOL_CALL_TYPE`: its keys only (an empty list is no calls: null)."""
    if not calls:
        return None
    out = []
    for call in calls:
        function = call.get("function") or {}
        out.append({"id": call.get("id"), "type": call.get("type"),
                    "function": {"name": function.get("name"), "arguments": function.get("arguments")}})
    return out


def _arrow_token(entry: Mapping[str, Any]) -> dict[str, Any]:
    raw = entry.get("bytes")
    return {**{k: entry.get(k) for k in _TOKEN_KEYS}, "bytes": None if raw is None else bytes(raw)}


def _arrow_logprobs(steps: Any) -> list[dict[str, Any]] | None:
    """A completion's logprobs for :data:`LOGPROB_TYPE`; None when absent or in the earlier row form
    (``{"<token id>": logprob}`` per token, which holds no token text)."""
    if not steps or not all(isinstance(s, Mapping) and "logprob" in s for s in steps):
        return None
    return [{**_arrow_token(s), "top_logprobs": [_arrow_token(t) for t in s.get("top_logprobs") or ()]}
            for s in steps]


def arrow_table(rows: Iterable[Mapping[str, Any]], vector: pa.DataType | None | str = "auto",
                kept: pa.Schema | None = None) -> pa.Table:
    """Rows as a table of ``result_schema(vector, kept)``; a value of the wrong type raises naming the
    row. The ``kept`` columns come from each row's :data:`KEPT_KEY` dict (absent: nulls).

    ``vector="auto"``: the type the rows' own vectors call for (:func:`vector_type_of`). A row with
    vectors in a table without vector columns, or of a width the type cannot hold, raises.
    """
    rows = list(rows)
    if vector == "auto":
        vector = vector_type_of(rows)
    elif isinstance(vector, str):
        raise ValueError(f"vector must be a pyarrow type, None or 'auto', got {vector!r}")
    schema = result_schema(vector)
    table = _result_table(rows, schema, vector)
    if kept:
        table = _with_kept(table, rows, kept)
    return table


def _result_table(rows: list[Mapping[str, Any]], schema: pa.Schema, vector: pa.DataType | None) -> pa.Table:
    plain = pa.schema([f for f in schema if f.name not in VECTOR_FIELDS])
    records = [arrow_record(r, plain) for r in rows]
    try:
        table = pa.Table.from_pylist(records, schema=plain)
    except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, OverflowError) as e:
        # Find the offending row so the error can name it.
        for rec in records:
            try:
                pa.Table.from_pylist([rec], schema=plain)
            except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, OverflowError) as one:
                raise ValueError(f"result row {rec.get('request_id')!r} does not fit the result schema: "
                                 f"{one}") from None
        raise ValueError(f"result rows do not fit the result schema: {e}") from None
    if vector is None:
        for r in rows:
            if r.get("embeddings"):
                raise ValueError(f"result row {r.get('request_id')!r} has embeddings, but the file was "
                                 "started without embedding columns")
        return table
    for name, array in zip(VECTOR_FIELDS, vector_arrays(rows, vector), strict=True):
        table = table.append_column(schema.field(name), array)
    return table


def _with_kept(table: pa.Table, rows: list[Mapping[str, Any]], kept: pa.Schema) -> pa.Table:
    """``table`` with the kept columns appended, built from the rows' kept values in their types."""
    try:
        values = pa.Table.from_pylist([r.get(KEPT_KEY) or {} for r in rows], schema=kept)
    except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, OverflowError) as e:
        raise ValueError(f"kept values do not fit the kept columns' types: {e}") from None
    for field, column in zip(kept, values.columns, strict=True):
        table = table.append_column(field, column)
    return table


class RowGroups:
    """Rows in, tables of ``result_schema(vector)`` out, to write one Parquet row group each, in order.

    :meth:`add` takes one row and returns the tables completed by it (usually none); :meth:`finish`
    the rest. A table is complete once it holds ``row_group_rows`` rows or ``row_group_bytes`` of
    Arrow data. Rows are converted (:func:`arrow_table`) in batches of at most ``batch_rows`` rows
    and about ``row_group_bytes / 8`` (sized from the rows converted so far; the first batch is
    small), so memory holds one row group in Arrow's columnar form plus one batch of row dicts,
    whatever the number and the size of the rows. Rows are pushed, so one pass over a job's rows
    can feed several files (the output file and the error file).
    """

    def __init__(self, vector: pa.DataType | None, *, row_group_rows: int, row_group_bytes: int,
                 batch_rows: int, kept: pa.Schema | None = None):
        if batch_rows < 1 or row_group_rows < 1:
            raise ValueError(f"batch_rows and row_group_rows must be >= 1, got {batch_rows}, "
                             f"{row_group_rows}")
        self.vector, self.kept = vector, kept
        self.row_group_rows, self.row_group_bytes = row_group_rows, row_group_bytes
        self.batch_rows = batch_rows
        self._pending: list[pa.Table] = []
        self._held = self._nbytes = 0  # rows and Arrow bytes in pending
        self._done_rows = self._done_bytes = 0  # every row converted so far: the rows' mean size
        self._limit = min(batch_rows, _FIRST_BATCH_ROWS)
        self._batch: list[Mapping[str, Any]] = []

    def add(self, row: Mapping[str, Any]) -> list[pa.Table]:
        """Take ``row``; the row groups it completes."""
        self._batch.append(row)
        # never past a row group's row count: groups are cut where whole-group chunks cut them
        if len(self._batch) >= min(self._limit, self.row_group_rows - self._held):
            return self._convert()
        return []

    @property
    def held_bytes(self) -> int:
        """Arrow bytes converted and not yet handed out (the rows of the next row group)."""
        return self._nbytes

    def finish(self) -> list[pa.Table]:
        """The last row groups (the rows held); rows added afterwards start a new group."""
        done = self._convert() if self._batch else []
        if self._pending:
            done.append(pa.concat_tables(self._pending))
            self._pending, self._held, self._nbytes = [], 0, 0
        return done

    def _convert(self) -> list[pa.Table]:
        table = arrow_table(self._batch, self.vector, self.kept)
        self._batch = []
        self._pending.append(table)
        self._held += table.num_rows
        self._nbytes += table.nbytes
        self._done_rows += table.num_rows
        self._done_bytes += table.nbytes
        self._limit = max(1, min(self.batch_rows,
                                 self.row_group_bytes // 8 * self._done_rows // max(self._done_bytes, 1)))
        if self._held >= self.row_group_rows or self._nbytes >= self.row_group_bytes:
            group = pa.concat_tables(self._pending)
            self._pending, self._held, self._nbytes = [], 0, 0
            return [group]
        return []


def protocol_row(rec: Mapping[str, Any]) -> dict[str, Any]:
    """A Parquet row read back (``to_pylist``) as the protocol's row dict: ms timestamps, JSON
    columns parsed, the ``embedding`` / ``embeddings`` arrays as ``embeddings`` base64 float32."""
    row = dict(rec)
    for name in ("created_at", "started_at", "finished_at"):
        value = row.get(name)
        if value is not None and hasattr(value, "timestamp"):
            row[name] = int(value.timestamp() * 1000)
    for name in _JSON_COLUMNS:
        if isinstance(row.get(name), str):
            row[name] = json.loads(row[name])
    if "embedding" in row:
        first, every = row.pop("embedding"), row.pop("embeddings", None)
        vectors = every if every is not None else None if first is None else [first]
        row["embeddings"] = None if vectors is None else [encode_vector(v) for v in vectors]
    return row


def jsonl_line(row: Mapping[str, Any]) -> str:
    """The row itself (docs/protocol.md field names), one JSON object per line.

    A row with the ``embeddings`` field has its vectors as JSON floats, in the Parquet columns'
    shape: ``embedding`` the first vector, ``embeddings`` every vector when there are several
    (else null); the base64 text is not written. Kept input columns (:data:`KEPT_KEY`) follow the
    row's own keys, as JSON values (dates as ISO text).
    """
    if KEPT_KEY in row:
        kept = row[KEPT_KEY] or {}
        row = {**{k: v for k, v in row.items() if k != KEPT_KEY},
               **{k: json_value(v) for k, v in kept.items()}}
    if "embeddings" in row:
        vectors = decoded_vectors(row)
        row = {**row, "embedding": vectors[0] if vectors else None,
               "embeddings": vectors if vectors is not None and len(vectors) > 1 else None}
    return json.dumps(row, ensure_ascii=False, separators=(",", ":"))


#: The text formats: each row's line.
LINE_FORMATS: dict[str, Callable[[Mapping[str, Any]], str]] = {
    "jsonl": jsonl_line, "openai": openai_line, "anthropic": anthropic_line}
