"""Result rows as output records: the typed Parquet schema, JSONL lines, OpenAI batch output lines.

A result row arrives as the JSON object of docs/protocol.md (``row`` field of a results stream
entry). Everything here is pure: dict in, Arrow table or text line out. Embedding rows carry
their vectors as base64 float32 (``embeddings``); :mod:`batchinfer.jobs.vectors` turns them into
the Parquet array columns and back.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import pyarrow as pa

from batchinfer.jobs.vectors import VECTOR_FIELDS, decoded_vectors, vector_arrays, vector_type_of
from batchinfer.protocol.rows import encode_vector

FORMATS = ("parquet", "jsonl", "openai")
EXTENSIONS = {"parquet": ".parquet", "jsonl": ".jsonl", "openai": ".jsonl"}

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
))

_JSON_COLUMNS = ("sampling_params", "metadata", "pooling_params")
_OUTPUT_KEYS = ("index", "text", "token_ids", "finish_reason", "cumulative_logprob", "structured",
                "structured_complete")
_TOKEN_KEYS = ("token_id", "token", "logprob")
_FIRST_BATCH_ROWS = 8  # rows of unknown size converted at once; later batches are sized from them


def result_schema(vector: pa.DataType | None = None) -> pa.Schema:
    """The Parquet schema of a file whose vectors are of type ``vector`` (None: no embedding rows).

    Without embedding rows it is :data:`RESULT_SCHEMA` itself (generation files are unchanged);
    with them three columns follow it: ``pooling_params`` (JSON text), ``embedding`` (the row's
    first vector, ``vector``: ``fixed_size_list<float32>[dim]`` when every vector of the file has
    one width, else ``list<float32>``) and ``embeddings`` (``list<vector>``: every vector of a row
    that has more than one, i.e. a list ``input``; null otherwise).
    """
    if vector is None:
        return RESULT_SCHEMA
    return pa.schema((*RESULT_SCHEMA, pa.field("pooling_params", pa.string()),
                      pa.field("embedding", vector), pa.field("embeddings", pa.list_(vector))))


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
    return rec


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


def arrow_table(rows: Iterable[Mapping[str, Any]], vector: pa.DataType | None | str = "auto") -> pa.Table:
    """Rows as a table of ``result_schema(vector)``; a value of the wrong type raises naming the row.

    ``vector="auto"``: the type the rows' own vectors call for (:func:`vector_type_of`). A row with
    vectors in a table without vector columns, or of a width the type cannot hold, raises.
    """
    rows = list(rows)
    if vector == "auto":
        vector = vector_type_of(rows)
    elif isinstance(vector, str):
        raise ValueError(f"vector must be a pyarrow type, None or 'auto', got {vector!r}")
    schema = result_schema(vector)
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


def arrow_row_groups(rows: Iterable[Mapping[str, Any]], vector: pa.DataType | None, *, row_group_rows: int,
                     row_group_bytes: int, batch_rows: int) -> Iterator[pa.Table]:
    """Rows as tables of ``result_schema(vector)`` to write one Parquet row group each, in order.

    A table is yielded once it holds ``row_group_rows`` rows or ``row_group_bytes`` of Arrow data.
    Rows are converted (:func:`arrow_table`) in batches of at most ``batch_rows`` rows and about
    ``row_group_bytes / 8`` (sized from the rows converted so far; the first batch is small), so
    memory holds one row group in Arrow's columnar form plus one batch of row dicts, whatever the
    number and the size of the rows.
    """
    if batch_rows < 1 or row_group_rows < 1:
        raise ValueError(f"batch_rows and row_group_rows must be >= 1, got {batch_rows}, {row_group_rows}")
    pending: list[pa.Table] = []
    held = nbytes = 0  # rows and Arrow bytes in pending
    done_rows = done_bytes = 0  # every row converted so far: the rows' mean size
    limit = min(batch_rows, _FIRST_BATCH_ROWS)
    batch: list[Mapping[str, Any]] = []

    def convert() -> Iterator[pa.Table]:
        nonlocal pending, held, nbytes, done_rows, done_bytes, limit
        table = arrow_table(batch, vector)
        batch.clear()
        pending.append(table)
        held += table.num_rows
        nbytes += table.nbytes
        done_rows += table.num_rows
        done_bytes += table.nbytes
        limit = max(1, min(batch_rows, row_group_bytes // 8 * done_rows // max(done_bytes, 1)))
        if held >= row_group_rows or nbytes >= row_group_bytes:
            yield pa.concat_tables(pending)
            pending, held, nbytes = [], 0, 0

    for row in rows:
        batch.append(row)
        # never past a row group's row count: groups are cut where whole-group chunks cut them
        if len(batch) >= min(limit, row_group_rows - held):
            yield from convert()
    if batch:
        yield from convert()
    if pending:
        yield pa.concat_tables(pending)


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
    (else null); the base64 text is not written.
    """
    if "embeddings" in row:
        vectors = decoded_vectors(row)
        row = {**row, "embedding": vectors[0] if vectors else None,
               "embeddings": vectors if vectors is not None and len(vectors) > 1 else None}
    return json.dumps(row, ensure_ascii=False, separators=(",", ":"))


# OpenAI's codes for requests a batch never ran.
# keyed by a row's status, which a foreign row may lack (None)
_OPENAI_ERROR_CODES: dict[str | None, str] = {"cancelled": "batch_cancelled", "expired": "batch_expired"}


def openai_line(row: Mapping[str, Any]) -> str:
    """One line of the OpenAI batch output format: ``id``, ``custom_id``, ``response``, ``error``.

    Completed rows get ``response.status_code`` 200 and a ``chat.completion`` body (when the row's
    ``url`` / ``endpoint`` says ``/v1/chat/completions``), an embeddings ``list`` body (a row with
    vectors, or ``/v1/embeddings``) or a ``text_completion`` body, with usage.
    Other rows get ``response: null`` and ``error`` {``code``, ``message``}.
    """
    request_id = row.get("request_id")
    out: dict[str, Any] = {"id": f"batch_req_{request_id}", "custom_id": row.get("custom_id"),
                           "response": None, "error": None}
    status = row.get("status")
    if status == "completed":
        out["response"] = {"status_code": 200, "request_id": request_id, "body": _openai_body(row)}
    else:
        code = _OPENAI_ERROR_CODES.get(status) or row.get("error_code") or status
        out["error"] = {"code": code, "message": _error_message(row), "line": row.get("line")}
    return json.dumps(out, ensure_ascii=False, separators=(",", ":"))


# Python's json position suffix, which counts lines and columns of the body text, not of the file.
_JSON_POSITION = re.compile(r": line (\d+) column (\d+) \(char \d+\)")


def _error_message(row: Mapping[str, Any]) -> str:
    """A failed row's message as a person fixing the input file reads it: "line 7: invalid JSON:
    Expecting ',' delimiter (column 44)" (the file's line from the row's ``line``; the body's own
    line only when the body spans several)."""
    status = row.get("status")
    message = row.get("error_message") or f"request {status}"

    def position(m: re.Match[str]) -> str:
        body_line, column = m.group(1), m.group(2)
        if body_line == "1":
            return f" (column {column})"
        return f" (line {body_line} of the body, column {column})"

    message = _JSON_POSITION.sub(position, message)
    line = row.get("line")
    if status == "failed" and isinstance(line, int) and not message.startswith("line "):
        message = f"line {line}: {message}"
    return message


def _openai_body(row: Mapping[str, Any]) -> dict[str, Any]:
    if row.get("embeddings") is not None or (row.get("url") or row.get("endpoint")) == "/v1/embeddings":
        return _openai_embeddings(row)
    chat = (row.get("url") or row.get("endpoint")) == "/v1/chat/completions"
    outputs = row.get("outputs") or [{"index": 0, "text": row.get("output_text") or "",
                                      "finish_reason": row.get("finish_reason")}]
    choices = []
    for o in outputs:
        choice: dict[str, Any] = {"index": o.get("index", 0)}
        if chat:
            choice["message"] = {"role": "assistant", "content": o.get("text") or ""}
        else:
            choice["text"] = o.get("text") or ""
        choice["logprobs"] = _openai_logprobs(o.get("logprobs"), chat)
        choice["finish_reason"] = o.get("finish_reason") or row.get("finish_reason")
        choices.append(choice)
    prompt, completion = row.get("prompt_tokens") or 0, row.get("completion_tokens") or 0
    finished = row.get("finished_at")
    return {
        "id": f"{'chatcmpl' if chat else 'cmpl'}-{row.get('request_id')}",
        "object": "chat.completion" if chat else "text_completion",
        "created": int(finished // 1000) if isinstance(finished, (int, float)) else None,
        "model": row.get("model"),
        "choices": choices,
        "usage": {"prompt_tokens": prompt, "completion_tokens": completion,
                  "total_tokens": prompt + completion,
                  "prompt_tokens_details": {"cached_tokens": row.get("cached_tokens") or 0}},
    }


def _openai_embeddings(row: Mapping[str, Any]) -> dict[str, Any]:
    """OpenAI's embeddings response: one ``data`` item per input, floats, or the row's own base64
    float32 text when the request asked ``encoding_format: "base64"`` (OpenAI's base64 is that)."""
    params = row.get("pooling_params")
    if isinstance(params, str):
        params = json.loads(params)
    as_text = isinstance(params, Mapping) and params.get("encoding_format") == "base64"
    texts = row.get("embeddings") or []
    vectors = texts if as_text else decoded_vectors(row) or []
    prompt = row.get("prompt_tokens") or 0
    return {"object": "list",
            "data": [{"object": "embedding", "index": i, "embedding": v} for i, v in enumerate(vectors)],
            "model": row.get("model"), "usage": {"prompt_tokens": prompt, "total_tokens": prompt}}


def _openai_logprobs(steps: Any, chat: bool) -> dict[str, Any] | None:
    """A choice's ``logprobs`` in OpenAI's shape: chat ``{content: [...], refusal}``, completions
    ``{tokens, token_logprobs, top_logprobs, text_offset}``; None when not asked for (or rows of the
    earlier ``{"<token id>": logprob}`` form, which hold no token text)."""
    if steps is None or not all(isinstance(s, Mapping) and "logprob" in s for s in steps):
        return None
    if chat:
        def token(e: Mapping[str, Any]) -> dict[str, Any]:
            return {"token": e.get("token"), "logprob": e.get("logprob"), "bytes": e.get("bytes")}

        return {"content": [{**token(s), "top_logprobs": [token(t) for t in s.get("top_logprobs") or ()]}
                            for s in steps], "refusal": None}
    tokens = [s.get("token") or "" for s in steps]
    offsets, at = [], 0
    for t in tokens:  # offsets into the completion's text, as vLLM counts them (no echo of the prompt)
        offsets.append(at)
        at += len(t)
    tops = []
    for s in steps:
        # OpenAI: the top `logprobs` tokens and always the sampled one (so up to logprobs + 1)
        top: dict[str, float] = {}
        for e in [*(s.get("top_logprobs") or ()), s]:
            top.setdefault(e.get("token") or "", e.get("logprob"))
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": [s.get("logprob") for s in steps], "top_logprobs": tops,
            "text_offset": offsets}
