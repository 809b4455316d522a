"""What the vendor line formats (:mod:`batchinfer.jobs.openai_lines`, :mod:`batchinfer.jobs.anthropic_lines`)
read from a result row: opaque ids, the completions with their tool calls, an error's message.

Pure functions of a row dict (docs/protocol.md, "Result row"); a row read back from Parquet
(:func:`batchinfer.jobs.formats.protocol_row`) works too: its outputs have no ``tool_calls`` of their
own, so the first completion takes the row's ``tool_calls`` column.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from typing import Any

from batchinfer import __version__


def opaque_id(kind: str, key: Any, length: int = 32) -> str:
    """``length`` hex characters, the same for the same ``kind`` and ``key`` (a request id, a call id).

    Vendors' ids are opaque tokens without separators (OpenAI's ``batch_req_...``, Anthropic's
    ``msg_...``); ours are derived, so a row gets the same ids in every export. ``kind`` keeps the
    ids of one request's several objects (line, completion, message) apart.
    """
    return hashlib.sha256(f"{kind}\0{key}".encode()).hexdigest()[:length]


def system_fingerprint(model: Any) -> str:
    """OpenAI's ``system_fingerprint``: ``fp_`` and 10 hex characters of the model's name and
    batchinfer's version, so it changes when either does (what it tells OpenAI's users)."""
    return "fp_" + opaque_id("fingerprint", f"{model}|batchinfer {__version__}", 10)


def seconds(ms: Any) -> int | None:
    """A row's ms timestamp as unix seconds (None when absent)."""
    return int(ms // 1000) if isinstance(ms, (int, float)) and not isinstance(ms, bool) else None


def completions(row: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The row's completions, each with its ``tool_calls`` (None when it made none).

    A row without ``outputs`` (an older or foreign producer) gives one completion from
    ``output_text`` / ``finish_reason``. An output without a ``tool_calls`` key (a row read back
    from Parquet, whose ``outputs`` struct has no such field) takes the row's ``tool_calls`` for
    the first completion.
    """
    outputs = row.get("outputs") or [{"index": 0, "text": row.get("output_text") or "",
                                      "finish_reason": row.get("finish_reason")}]
    found = []
    for i, output in enumerate(outputs):
        calls = output["tool_calls"] if "tool_calls" in output else row.get("tool_calls") if i == 0 else None
        found.append({**output, "tool_calls": list(calls) if calls else None,
                      "finish_reason": output.get("finish_reason") or row.get("finish_reason")})
    return found


def sampling_params(row: Mapping[str, Any]) -> dict[str, Any]:
    """The row's ``sampling_params`` as a dict (a JSON text when read from a Parquet file)."""
    params = row.get("sampling_params")
    if isinstance(params, str):
        params = json.loads(params)
    return dict(params) if isinstance(params, Mapping) else {}


# Python's json position suffix, which counts lines and columns of the body text, not of the file.
_JSON_POSITION = re.compile(r": line (\d+) column (\d+) \(char \d+\)")


def error_message(row: Mapping[str, Any]) -> str:
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


def compact(value: Any) -> str:
    """One output line: compact JSON, non-ASCII kept."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))
