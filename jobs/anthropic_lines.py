"""Anthropic Message Batches result lines (``--format anthropic``): one result row, one line.

A line is ``{"custom_id", "result": {...}}`` as Anthropic's batch results file writes it: a
``succeeded`` result holds a ``message`` (the first completion: a ``text`` block and ``tool_use``
blocks), a failed row is ``errored`` with an Anthropic error object, a cancelled row ``canceled``
and an expired one ``expired``. docs/results.md shows the shapes; the ``anthropic`` package's
``MessageBatchIndividualResponse`` parses them (tests/test_anthropic_lines.py).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from batchinfer.jobs.openai_lines import kept_json
from batchinfer.jobs.row_views import compact, completions, error_message, opaque_id

#: Our row error codes -> Anthropic's error types: what the caller must fix is an
#: ``invalid_request_error``, a model no worker serves ``not_found_error``, and what failed here
#: (the engine, a worker's crashes) ``api_error``. A code not listed is an ``api_error``.
ERROR_TYPES = {
    "invalid_json": "invalid_request_error",
    "invalid_request": "invalid_request_error",
    "line_too_long": "invalid_request_error",
    "unsupported_url": "invalid_request_error",
    "prompt_too_long": "invalid_request_error",
    "protocol_error": "invalid_request_error",
    "unknown_model": "not_found_error",
    "engine_error": "api_error",
    "dead_lettered": "api_error",
}

# Anthropic's ids: a prefix and 24 characters
_ID_LENGTH = 24


def anthropic_line(row: Mapping[str, Any]) -> str:
    """One line of Anthropic's Message Batches results: ``custom_id`` (the row's, else its request
    id) and ``result``; a row with kept input columns gets them as a ``metadata`` object."""
    out: dict[str, Any] = {"custom_id": row.get("custom_id") or row.get("request_id"), "result": _result(row)}
    kept = kept_json(row)
    if kept is not None:
        out["metadata"] = kept
    return compact(out)


def _result(row: Mapping[str, Any]) -> dict[str, Any]:
    status = row.get("status")
    if status == "cancelled":
        return {"type": "canceled"}
    if status == "expired":
        return {"type": "expired"}
    if status != "completed":
        return _errored(ERROR_TYPES.get(row.get("error_code") or "", "api_error"), error_message(row))
    if row.get("embeddings") is not None:
        return _errored("invalid_request_error", "an embeddings result has no Anthropic Messages shape: "
                                                 "export it with --format openai, jsonl or parquet")
    return {"type": "succeeded", "message": message(row)}


def _errored(kind: str, text: str) -> dict[str, Any]:
    return {"type": "errored", "error": {"type": "error", "error": {"type": kind, "message": text}}}


def message(row: Mapping[str, Any]) -> dict[str, Any]:
    """A completed row's first completion as an Anthropic ``message`` object.

    ``stop_reason``: ``tool_use`` when it made calls, ``max_tokens`` when ``max_tokens`` cut it,
    ``stop_sequence`` (with ``stop_sequence`` the string) when a stop string ended it, else
    ``end_turn``. ``usage.input_tokens`` is the prompt tokens the prefix cache did not hold, as
    Anthropic counts them (``cache_read_input_tokens`` holds the others).
    """
    first = completions(row)[0]
    text, calls = first.get("text") or "", first["tool_calls"] or []
    content: list[dict[str, Any]] = [{"type": "text", "text": text}] if text else []
    content += [_tool_use(call) for call in calls]
    matched = first.get("stop_reason")  # the stop string or token id that ended it
    if calls:
        stop_reason = "tool_use"
    elif first["finish_reason"] == "length":
        stop_reason = "max_tokens"
    elif isinstance(matched, str):
        stop_reason = "stop_sequence"
    else:
        stop_reason = "end_turn"
    stop_sequence = matched if stop_reason == "stop_sequence" else None
    prompt, cached = row.get("prompt_tokens") or 0, row.get("cached_tokens") or 0
    return {
        "id": f"msg_{opaque_id('msg', row.get('request_id'), _ID_LENGTH)}",
        "type": "message",
        "role": "assistant",
        "model": row.get("model"),
        "content": content,
        "stop_reason": stop_reason,
        "stop_sequence": stop_sequence,
        "usage": {"input_tokens": max(prompt - cached, 0), "output_tokens": row.get("completion_tokens") or 0,
                  "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached,
                  "service_tier": "batch"},
    }


def _tool_use(call: Mapping[str, Any]) -> dict[str, Any]:
    """A call (OpenAI's shape) as a ``tool_use`` block: ``toolu_`` + the call id's token, the
    arguments parsed to an object (arguments that are not a JSON object: ``{"arguments": text}``)."""
    call_id = str(call.get("id") or "")
    token = call_id.removeprefix("call_") if call_id.startswith("call_") else opaque_id("toolu", call_id,
                                                                                          _ID_LENGTH)
    function = call.get("function") or {}
    raw = function.get("arguments")
    try:
        value = json.loads(raw) if isinstance(raw, str) else raw
    except ValueError:
        value = None
    return {"type": "tool_use", "id": f"toolu_{token}", "name": function.get("name"),
            "input": value if isinstance(value, dict) else {"arguments": raw}}
