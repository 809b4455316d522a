"""OpenAI Responses API request bodies (``/v1/responses`` Batch lines, docs/protocol.md) as chat bodies.

:func:`chat_body` maps a Responses ``body`` onto the chat body that :mod:`batchinfer.protocol.bodies`
validates like any ``/v1/chat/completions`` body: ``input`` (a string, or message / ``function_call``
/ ``function_call_output`` items) and ``instructions`` become ``messages``, ``max_output_tokens``
``max_tokens``, ``text.format`` ``response_format``, flat function ``tools`` chat tools. The shape
of what only the Responses API has is checked here; the rest is checked on the chat body, and
:func:`responses_path` names the Responses field of an error found there. Every error names the
path under ``body.`` (``body.input[2].content[0].type``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from batchinfer.protocol.entries import TEXT_ONLY, RequestError, renamed_path, short_repr

__all__ = ["RESPONSES_FIELDS", "chat_body", "responses_path"]

# Body fields, and what each becomes on the chat body (None: handled here).
_SAME = ("model", "temperature", "top_p", "metadata", "user", "store", "service_tier", "stream",
         "stream_options", "parallel_tool_calls", "safety_identifier", "prompt_cache_key")
RESPONSES_FIELDS = (*_SAME, "input", "instructions", "max_output_tokens", "text", "tools", "tool_choice",
                    "reasoning", "truncation")
MESSAGE_ROLES = ("user", "assistant", "system", "developer")
_MESSAGE_KEYS = ("type", "role", "content", "id", "status")
_CALL_KEYS = ("type", "call_id", "name", "arguments", "id", "status")
_OUTPUT_KEYS = ("type", "call_id", "output", "id", "status")
_TEXT_PARTS = {"input_text": ("type", "text"), "output_text": ("type", "text", "annotations", "logprobs")}
_NON_TEXT_PARTS = ("input_image", "input_file", "input_audio")
_FORMAT_KEYS = {"text": ("type",), "json_object": ("type",),
                "json_schema": ("type", "name", "schema", "strict", "description")}
_TOOL_KEYS = ("type", "name", "description", "parameters", "strict")


def _bad(message: str, path: str) -> RequestError:
    return RequestError("invalid_request", message, field=path)


def _keys(obj: Mapping[str, Any], allowed: tuple[str, ...], path: str, what: str) -> None:
    unknown = sorted(str(k) for k in obj if k not in allowed)
    if unknown:
        raise _bad(f"{path}.{unknown[0]} is not a field of {what} (it takes {', '.join(allowed)})",
                   f"{path}.{unknown[0]}")


def _object(value: Any, path: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise _bad(f"{path} must be an object, got {short_repr(value)}", path)
    return value


def _string(value: Any, path: str) -> str:
    if not isinstance(value, str):
        raise _bad(f"{path} must be a string, got {short_repr(value)}", path)
    return value


def chat_body(body: Mapping[str, Any]) -> dict[str, Any]:
    """The chat body of a Responses ``body`` (``custom_id`` included, as the Batch line gave it)."""
    unknown = sorted(str(k) for k in body if k not in (*RESPONSES_FIELDS, "custom_id"))
    if unknown:
        raise _bad(f"unknown field(s) in a /v1/responses body: {', '.join(unknown)}", f"body.{unknown[0]}")
    out: dict[str, Any] = {k: body[k] for k in (*_SAME, "custom_id") if k in body}
    if body.get("input") is None:
        raise _bad("/v1/responses needs 'input' (a string or a list of items)", "body.input")
    messages = _input(body["input"])
    instructions = body.get("instructions")
    if instructions is not None:
        messages.insert(0, {"role": "system", "content": _string(instructions, "body.instructions")})
    if not messages:
        raise _bad("body.input must hold at least one message", "body.input")
    out["messages"] = messages
    if "max_output_tokens" in body:
        out["max_tokens"] = body["max_output_tokens"]
    if body.get("text") is not None:
        response_format = _text(body["text"])
        if response_format is not None:
            out["response_format"] = response_format
    if body.get("tools") is not None:
        out["tools"] = _tools(body["tools"])
    if body.get("tool_choice") is not None:
        out["tool_choice"] = _tool_choice(body["tool_choice"])
    if body.get("reasoning") is not None:  # accepted, no effect: the models here do not reason apart
        _object(body["reasoning"], "body.reasoning")
    truncation = body.get("truncation")
    if truncation not in (None, "disabled"):
        raise _bad(f"body.truncation {short_repr(truncation)} is not supported: only \"disabled\" (a prompt "
                   "longer than the context is a prompt_too_long row, never cut)", "body.truncation")
    return out


# -- input -------------------------------------------------------------------------------------------


def _input(value: Any) -> list[dict[str, Any]]:
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list):
        raise _bad(f"body.input must be a string or a list of items, got {short_repr(value)}", "body.input")
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(value):
        path = f"body.input[{i}]"
        item = _object(item, path)
        kind = item.get("type", "message")
        if kind == "message":
            _keys(item, _MESSAGE_KEYS, path, "a message item")
            role = item.get("role")
            if role not in MESSAGE_ROLES:
                raise _bad(f"{path}.role must be one of {', '.join(MESSAGE_ROLES)}, got {short_repr(role)}",
                           f"{path}.role")
            messages.append({"role": role, "content": _content(item.get("content"), f"{path}.content")})
        elif kind == "function_call":
            _keys(item, _CALL_KEYS, path, "a function_call item")
            call = {"id": _string(item.get("call_id"), f"{path}.call_id"), "type": "function",
                    "function": {"name": _string(item.get("name"), f"{path}.name"),
                                 "arguments": _string(item.get("arguments"), f"{path}.arguments")}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":  # one turn: its text and its calls
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            _keys(item, _OUTPUT_KEYS, path, "a function_call_output item")
            messages.append({"role": "tool", "tool_call_id": _string(item.get("call_id"), f"{path}.call_id"),
                             "content": _content(item.get("output"), f"{path}.output")})
        elif kind == "reasoning":
            continue  # an earlier response's reasoning: no model here reads it back (dropped)
        else:
            raise _bad(f"{path}.type {short_repr(kind)} is not supported (items: message, function_call, "
                       "function_call_output, reasoning)", f"{path}.type")
    return messages


def _content(value: Any, path: str) -> str | list[dict[str, str]]:
    """A string, or input_text / output_text parts as chat text parts."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise _bad(f"{path} must be a string or a list of input_text parts, got {short_repr(value)}", path)
    parts = []
    for j, part in enumerate(value):
        where = f"{path}[{j}]"
        part = _object(part, where)
        kind = part.get("type")
        if kind in _NON_TEXT_PARTS:
            raise _bad(f"{where}: {kind} parts are not supported: {TEXT_ONLY}", f"{where}.type")
        if kind not in _TEXT_PARTS:
            raise _bad(f"{where}.type must be input_text or output_text, "
                       f"got {short_repr(kind)}", f"{where}.type")
        _keys(part, _TEXT_PARTS[kind], where, f"an {kind} part")
        parts.append({"type": "text", "text": _string(part.get("text"), f"{where}.text")})
    return parts


# -- text.format, tools ------------------------------------------------------------------------------


def _text(value: Any) -> dict[str, Any] | None:
    """``text: {format, verbosity}`` as a chat ``response_format`` (None: free text)."""
    text = _object(value, "body.text")
    _keys(text, ("format", "verbosity"), "body.text", "text")
    if text.get("verbosity") is not None:  # accepted, no effect (a hint to OpenAI's own models)
        _string(text["verbosity"], "body.text.verbosity")
    if text.get("format") is None:
        return None
    fmt = _object(text["format"], "body.text.format")
    kind = fmt.get("type")
    if kind not in _FORMAT_KEYS:
        raise _bad(f"body.text.format.type must be one of {', '.join(_FORMAT_KEYS)}, got {short_repr(kind)}",
                   "body.text.format.type")
    _keys(fmt, _FORMAT_KEYS[kind], "body.text.format", f"a {kind!r} format")
    if kind != "json_schema":
        return {"type": kind}
    return {"type": "json_schema", "json_schema": {k: fmt[k] for k in _FORMAT_KEYS[kind][1:] if k in fmt}}


def _tools(value: Any) -> Any:
    """Flat function tools ``{type, name, description, parameters, strict}`` as chat tools."""
    if not isinstance(value, list):
        return value  # parse_tools names the field
    out = []
    for i, tool in enumerate(value):
        path = f"body.tools[{i}]"
        tool = _object(tool, path)
        kind = tool.get("type")
        if kind != "function":
            raise _bad(f"{path}.type {short_repr(kind)} is not available here: only function tools (the "
                       "hosted tools run on OpenAI's servers)", f"{path}.type")
        _keys(tool, _TOOL_KEYS, path, "a function tool")
        out.append({"type": "function", "function": {k: tool[k] for k in _TOOL_KEYS[1:] if k in tool}})
    return out


def _tool_choice(value: Any) -> Any:
    """``{"type": "function", "name": N}`` as chat's ``{"type": "function", "function": {"name": N}}``."""
    if isinstance(value, str) or not isinstance(value, Mapping):
        return value  # "none" / "auto" / "required", or a wrong value parse_tools names
    kind = value.get("type")
    if kind != "function":
        raise _bad(f"body.tool_choice.type {short_repr(kind)} is not supported: give none, auto, required or "
                   "{\"type\": \"function\", \"name\": ...}", "body.tool_choice.type")
    _keys(value, ("type", "name"), "body.tool_choice", "a function tool_choice")
    return {"type": "function", "function": {"name": value.get("name")}}


# -- errors found on the chat body -------------------------------------------------------------------

_RENAMES: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"^max_tokens"), "max_output_tokens"),
    (re.compile(r"^messages.*"), "input"),
    (re.compile(r"^tools\[(\d+)\]\.function"), r"tools[\1]"),
    (re.compile(r"^tool_choice\.function"), "tool_choice"),
    (re.compile(r"^response_format(\.json_schema)?"), "text.format"),
)


def responses_path(chat_field: str) -> str:
    """The ``body.`` path of the Responses field that chat body field ``chat_field`` came from."""
    return renamed_path(chat_field, _RENAMES, "body")
