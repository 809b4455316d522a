"""The ``llama3_json`` format (Llama 3.1 / 3.2 / 4 with their own templates): the whole output is
a JSON call ``{"name": ..., "parameters": {...}}`` (or ``"arguments"``), optionally after
``<|python_tag|>``; several calls are separated by ``;``. A call has no content beside it.

    {"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {}}
"""

from __future__ import annotations

from batchinfer.workers.tools.parsed import MalformedToolCall, Parsed, call_from_object, raw_decode

PYTHON_TAG = "<|python_tag|>"


def parse(text: str) -> Parsed | None:
    """The calls in ``text``; None when it is not a JSON object (after ``<|python_tag|>``)."""
    body = text.strip()
    if body.startswith(PYTHON_TAG):
        body = body[len(PYTHON_TAG):].strip()
    if not body.startswith("{"):
        return None
    calls = []
    pos = 0
    while True:
        obj, pos = raw_decode(body, pos)
        calls.append(call_from_object(obj, ("parameters", "arguments")))
        rest = body[pos:].lstrip()
        if not rest:
            return None, calls
        if not rest.startswith(";"):
            raise MalformedToolCall(f"calls must be separated by ';', got {rest[:40]!r}")
        pos = len(body) - len(rest) + 1
