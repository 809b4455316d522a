"""``extract_tool_calls``: a completion's text -> its content and OpenAI ``tool_calls``.

``required`` / a named function: the output was constrained to ``ToolSpec.call_schema()`` and is
read as that JSON. ``auto``: the worker's parser finds the calls; a call it cannot read, or one
naming a function the request did not give, leaves the whole text as content (vLLM's behaviour).
"""

from __future__ import annotations

import hashlib
import json
import string
from dataclasses import dataclass
from typing import Any

from batchinfer.workers.tools.parsed import MalformedToolCall, ParsedCall, loads
from batchinfer.workers.tools.parsers import parser_function
from batchinfer.workers.tools.spec import ToolSpec

_ALPHABET = string.ascii_letters + string.digits
ID_LENGTH = 24


class ToolParserMissing(ValueError):
    """``tool_choice: auto`` on a worker that knows no parser for its model's output format."""


@dataclass(frozen=True)
class ToolCallResult:
    """A completion's content (None when it was only calls) and its calls (None when none)."""

    content: str | None
    tool_calls: list[dict[str, Any]] | None


def call_id(seed: str, index: int) -> str:
    """``call_`` + 24 letters and digits, the same for the same seed (request id and completion
    index) and call position: reruns of a batch give the same ids."""
    n = int.from_bytes(hashlib.sha256(f"{seed}\0{index}".encode()).digest(), "big")
    chars = []
    for _ in range(ID_LENGTH):
        n, r = divmod(n, len(_ALPHABET))
        chars.append(_ALPHABET[r])
    return "call_" + "".join(chars)


def require_parser(spec: ToolSpec | None, parser: str | None) -> None:
    """``ToolParserMissing`` when ``spec`` asks for ``auto`` and no ``parser`` can read the calls: a
    worker checks it before the request runs, so such a request costs no generation."""
    if spec is not None and spec.choice == "auto" and parser is None:
        raise ToolParserMissing(
            "tool_choice 'auto' needs a tool-call parser for this model's output format: start "
            "the worker with --tool-call-parser NAME (one of hermes, llama3_json, mistral, "
            "pythonic), use a model whose chat template names its format, or send "
            "tool_choice 'required' or a named function")


def extract_tool_calls(text: str, spec: ToolSpec | None, parser: str | None,
                       call_id_seed: Any) -> ToolCallResult:
    """Split ``text`` into content and tool calls for the request's ``spec`` (see the module doc).

    ``parser`` is a name of ``TOOL_PARSERS`` (used for ``auto`` only). ``ToolParserMissing`` when
    the choice is ``auto`` and ``parser`` is None."""
    as_text = ToolCallResult(text, None)
    if spec is None or spec.choice == "none":
        return as_text
    require_parser(spec, parser)
    if spec.choice == "auto":
        assert parser is not None  # require_parser
        parse = parser_function(parser)
        try:
            parsed = parse(text)
        except MalformedToolCall:
            return as_text
        if parsed is None:
            return as_text
        content, calls = parsed
    else:
        try:
            calls = _constrained_calls(text)
        except MalformedToolCall:
            return as_text  # cut short (max_tokens) before the JSON closed
        content = None
    names = set(spec.names())
    if not calls or any(name not in names for name, _ in calls):
        return as_text
    seed = str(call_id_seed)
    return ToolCallResult(content, [
        {"id": call_id(seed, i), "type": "function",
         "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}}
        for i, (name, args) in enumerate(calls)])


def _constrained_calls(text: str) -> list[ParsedCall]:
    """The calls of a ``call_schema`` output: ``[{"name": ..., "parameters": {...}}, ...]``."""
    value = loads(text)
    if not isinstance(value, list):
        raise MalformedToolCall("not a list of calls")
    out = []
    for item in value:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str) \
                or not isinstance(item.get("parameters"), dict):
            raise MalformedToolCall("not a call object")
        out.append((item["name"], item["parameters"]))
    return out


def finish_reason_with_tools(finish_reason: str | None,
                             tool_calls: list[dict[str, Any]] | None) -> str | None:
    """``"tool_calls"`` when the completion stopped (``"stop"``) having made calls; else unchanged."""
    return "tool_calls" if tool_calls and finish_reason == "stop" else finish_reason
