"""What the ``auto`` parsers share: their result type, the malformed-call error and strict JSON.

A parser returns :data:`Parsed` (the content outside the calls, and the calls as ``(name,
arguments)``), or None when the text holds no call; it raises :class:`MalformedToolCall` when the
text starts a call it cannot read. Either way the caller then returns the whole text as content,
as vLLM does.
"""

from __future__ import annotations

import json
from typing import Any

ParsedCall = tuple[str, dict[str, Any]]
Parsed = tuple[str | None, list[ParsedCall]]


class MalformedToolCall(ValueError):
    """The text starts a tool call in the parser's format but the call cannot be read."""


def _no_constant(name: str) -> Any:
    # json accepts NaN / Infinity by default; arguments must be JSON that every client can read.
    raise MalformedToolCall(f"{name} is not JSON")


_DECODER = json.JSONDecoder(parse_constant=_no_constant)


def loads(text: str) -> Any:
    """``json.loads`` without NaN / Infinity; ``MalformedToolCall`` on bad JSON."""
    value, end = raw_decode(text.strip(), 0)
    if end != len(text.strip()):
        raise MalformedToolCall(f"text after the JSON value: {text.strip()[end:][:40]!r}")
    return value


def raw_decode(text: str, pos: int) -> tuple[Any, int]:
    """One JSON value starting at ``text[pos]`` (after whitespace) and the index after it."""
    while pos < len(text) and text[pos].isspace():
        pos += 1
    try:
        return _DECODER.raw_decode(text, pos)
    except json.JSONDecodeError as e:
        raise MalformedToolCall(f"invalid JSON: {e}") from None
    except RecursionError:  # nesting deeper than Python's stack: not a call anyone can use
        raise MalformedToolCall("JSON nested too deeply") from None


def content_or_none(text: str) -> str | None:
    """``text`` stripped, None when nothing is left (OpenAI's ``content: null``)."""
    return text.strip() or None


def call_from_object(obj: Any, argument_keys: tuple[str, ...] = ("arguments",)) -> ParsedCall:
    """``(name, arguments)`` from a ``{"name": ..., "arguments": {...}}`` object; ``arguments``
    may also be a JSON string of an object (some fine-tunes write it so) or absent (no arguments)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        raise MalformedToolCall(f"a call must be an object with a name, got {obj!r:.80}")
    args: Any = {}
    for key in argument_keys:
        if key in obj:
            args = obj[key]
            break
    if isinstance(args, str):
        args = loads(args) if args.strip() else {}
    if not isinstance(args, dict):
        raise MalformedToolCall(f"the arguments of {obj['name']!r} must be an object, got {args!r:.80}")
    return obj["name"], args
