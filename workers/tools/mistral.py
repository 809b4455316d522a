"""The ``mistral`` format: the ``[TOOL_CALLS]`` token, then either a JSON list of
``{"name", "arguments"}`` objects (Mistral 7B v0.3, Mixtral, Nemo) or, from tokenizer v11 on
(Mistral Small 3.2, Magistral, Devstral), ``name[ARGS]{...}`` per call, each after its own
``[TOOL_CALLS]`` (a ``[CALL_ID]id`` between name and ``[ARGS]`` is skipped).

    Let me check.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]
    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}

The content is the text before the first ``[TOOL_CALLS]``. ``[TOOL_CALLS]`` is a special token:
the worker must keep special tokens in the text it parses. A text that is only a JSON list of
``{"name", "arguments"}`` objects (the token lost) is read as calls too.
"""

from __future__ import annotations

from typing import Any

from batchinfer.workers.tools.parsed import (
    MalformedToolCall,
    Parsed,
    ParsedCall,
    call_from_object,
    content_or_none,
    loads,
)

TOOL_CALLS, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"


def parse(text: str) -> Parsed | None:
    """The calls in ``text``; None when it has no ``[TOOL_CALLS]`` (nor is a bare call list)."""
    if TOOL_CALLS not in text:
        return _bare_list(text)
    content, *segments = text.split(TOOL_CALLS)
    calls: list[ParsedCall] = []
    for segment in segments:
        if ARGS in segment:
            name, _, args = segment.partition(ARGS)
            name = name.partition(CALL_ID)[0].strip()
            calls.append(call_from_object({"name": name, "arguments": loads(args)}))
        elif segment.strip():
            calls.extend(_call_list(loads(segment)))
    if not calls:
        raise MalformedToolCall("[TOOL_CALLS] without a call")
    return content_or_none(content), calls


def _call_list(value: Any) -> list[ParsedCall]:
    items = value if isinstance(value, list) else [value]
    return [call_from_object(item) for item in items]


def _bare_list(text: str) -> Parsed | None:
    body = text.strip()
    if not body.startswith("[{"):
        return None
    try:
        value = loads(body)
    except MalformedToolCall:
        return None
    if not isinstance(value, list) or not all(isinstance(v, dict) and set(v) == {"name", "arguments"}
                                              for v in value):
        return None
    return None, _call_list(value)
