"""Result rows as output records: the typed Parquet schema, JSONL lines, OpenAI batch output lines.

A result row arrives as the JSON object of docs/protocol.md (``row`` field of a results stream
entry). Everything here is pure: dict in, Arrow table or text line out.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Mapping
from typing import Any

import pyarrow as pa

FORMATS = ("parquet", "jsonl", "openai")
EXTENSIONS = {"parquet": ".parquet", "jsonl": ".jsonl", "openai": ".jsonl"}

_TS = pa.timestamp("ms", tz="UTC")
OUTPUT_TYPE = pa.struct([
    pa.field("index", pa.int32()),
    pa.field("text", pa.string()),
    pa.field("token_ids", pa.list_(pa.int32())),
    pa.field("finish_reason", pa.string()),
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
))

_JSON_COLUMNS = ("sampling_params", "metadata")
_OUTPUT_KEYS = ("index", "text", "token_ids", "finish_reason")


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


def arrow_record(row: Mapping[str, Any]) -> dict[str, Any]:
    """One row's values for :data:`RESULT_SCHEMA` (unknown keys dropped, JSON columns as text)."""
    rec = {name: row.get(name) for name in RESULT_SCHEMA.names}
    for name in _JSON_COLUMNS:
        rec[name] = _json_text(rec[name])
    outs = rec["outputs"]
    if outs is not None:
        rec["outputs"] = [{k: o.get(k) for k in _OUTPUT_KEYS} for o in outs]
    return rec


def arrow_table(rows: Iterable[Mapping[str, Any]]) -> pa.Table:
    """Rows as a table of :data:`RESULT_SCHEMA`; a value of the wrong type raises naming the row."""
    records = [arrow_record(r) for r in rows]
    try:
        return pa.Table.from_pylist(records, schema=RESULT_SCHEMA)
    except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, OverflowError) as e:
        # Find the offending row so the error can name it.
        for rec in records:
            try:
                pa.Table.from_pylist([rec], schema=RESULT_SCHEMA)
            except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, OverflowError) as one:
                raise ValueError(f"result row {rec.get('request_id')!r} does not fit the result schema: "
                                 f"{one}") from None
        raise ValueError(f"result rows do not fit the result schema: {e}") from None


def jsonl_line(row: Mapping[str, Any]) -> str:
    """The row itself (docs/protocol.md field names), one JSON object per line."""
    return json.dumps(row, ensure_ascii=False, separators=(",", ":"))


# OpenAI's codes for requests a batch never ran.
# keyed by a row's status, which a foreign row may lack (None)
_OPENAI_ERROR_CODES: dict[str | None, str] = {"cancelled": "batch_cancelled", "expired": "batch_expired"}


def openai_line(row: Mapping[str, Any]) -> str:
    """One line of the OpenAI batch output format: ``id``, ``custom_id``, ``response``, ``error``.

    Completed rows get ``response.status_code`` 200 and a ``chat.completion`` body (when the row's
    ``url`` / ``endpoint`` says ``/v1/chat/completions``) or a ``text_completion`` body, with usage.
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
        out["error"] = {"code": code, "message": row.get("error_message") or f"request {status}"}
    return json.dumps(out, ensure_ascii=False, separators=(",", ":"))


def _openai_body(row: Mapping[str, Any]) -> dict[str, Any]:
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
        choice["logprobs"] = None
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
