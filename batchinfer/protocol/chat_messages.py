"""Chat conversations in request bodies (docs/protocol.md, "messages"): roles, text content, and
the tool turns of OpenAI's shape (assistant ``tool_calls``, ``tool`` results with ``tool_call_id``).

Every problem is a :class:`~batchinfer.protocol.entries.RequestError` naming the exact path
(``messages[2].tool_calls[0].function.arguments``). Rendering is the scheduler's (the model's chat
template); only the shape is checked here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from batchinfer.protocol.entries import (
    MESSAGE_FIELDS,
    MESSAGE_ROLES,
    NON_TEXT_PARTS,
    TEXT_ONLY,
    RequestError,
    kind_name,
    short_repr,
)

__all__ = ["check_content", "check_messages"]


def check_messages(value: Any) -> list[dict[str, Any]]:
    """A non-empty list of messages, each checked; copies of them, in order."""
    if not isinstance(value, list) or not value:
        raise RequestError("invalid_request", f"messages must be a non-empty list, got {short_repr(value)}",
                           field="messages")
    out = []
    for i, m in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(m, Mapping):
            raise RequestError("invalid_request", f"{where} must be an object, got {kind_name(m)}",
                               field=where)
        unknown = sorted(str(k) for k in m if k not in MESSAGE_FIELDS)
        if unknown:
            raise RequestError("invalid_request", f"{where} has unknown field(s): {', '.join(unknown)}",
                               field=f"{where}.{unknown[0]}")
        role = m.get("role")
        if role not in MESSAGE_ROLES:
            raise RequestError("invalid_request", f"{where}.role must be one of {', '.join(MESSAGE_ROLES)}, "
                               f"got {short_repr(role)}", field=f"{where}.role")
        msg = dict(m)
        check_content(m.get("content"), f"{where}.content", bool(m.get("tool_calls")))
        for key in ("name", "tool_call_id"):
            if key in msg and not isinstance(msg[key], str):
                raise RequestError("invalid_request", f"{where}.{key} must be a string",
                                   field=f"{where}.{key}")
        if role == "tool" and "tool_call_id" not in msg:
            raise RequestError("invalid_request", f"{where} is a tool result: it needs tool_call_id (the id "
                               "of the call it answers)", field=f"{where}.tool_call_id")
        if msg.get("tool_calls") is not None:
            if role != "assistant":
                raise RequestError("invalid_request", f"{where}.tool_calls: only assistant messages make "
                                   "tool calls", field=f"{where}.tool_calls")
            _check_tool_calls(msg["tool_calls"], f"{where}.tool_calls")
        out.append(msg)
    return out


_CALL_FIELDS = ("id", "type", "function")


def _check_tool_calls(calls: Any, where: str) -> None:
    """OpenAI's shape: ``[{"id", "type": "function", "function": {"name", "arguments": JSON text}}]``."""
    if not isinstance(calls, list):
        raise RequestError("invalid_request", f"{where} must be a list", field=where)
    for i, call in enumerate(calls):
        at = f"{where}[{i}]"
        if not isinstance(call, Mapping):
            raise RequestError("invalid_request", f"{at} must be an object, got {kind_name(call)}", field=at)
        unknown = sorted(str(k) for k in call if k not in _CALL_FIELDS)
        if unknown:
            raise RequestError("invalid_request", f"{at} has unknown field(s): {', '.join(unknown)}",
                               field=f"{at}.{unknown[0]}")
        if not isinstance(call.get("id"), str):
            raise RequestError("invalid_request", f"{at}.id must be a string", field=f"{at}.id")
        if call.get("type") != "function":
            raise RequestError("invalid_request", f"{at}.type must be \"function\", got "
                               f"{short_repr(call.get('type'))}", field=f"{at}.type")
        function = call.get("function")
        if not isinstance(function, Mapping) or set(function) - {"name", "arguments"}:
            raise RequestError("invalid_request", f"{at}.function must be {{\"name\", \"arguments\"}}, got "
                               f"{short_repr(function)}", field=f"{at}.function")
        for key in ("name", "arguments"):
            if not isinstance(function.get(key), str):
                what = "a string (the arguments as JSON text)" if key == "arguments" else "a string"
                raise RequestError("invalid_request", f"{at}.function.{key} must be {what}, got "
                                   f"{short_repr(function.get(key))}", field=f"{at}.function.{key}")


def check_content(content: Any, where: str, has_tool_calls: bool) -> None:
    """A string, or a list of text parts (the tokenizer joins them); ``None`` only with tool calls."""
    if isinstance(content, str) or (content is None and has_tool_calls):
        return
    if not isinstance(content, list):
        raise RequestError("invalid_request", f"{where} must be a string or a list of text parts, got "
                           f"{short_repr(content)}", field=where)
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind in NON_TEXT_PARTS:
            raise RequestError("invalid_request", f"{where}[{j}]: {kind} parts are not supported: "
                               f"{TEXT_ONLY} (give only text parts)", field=f"{where}[{j}]")
        if kind != "text" or not isinstance(part.get("text"), str):
            raise RequestError("invalid_request", f"{where}[{j}] must be a text part {{\"type\": \"text\", "
                               f"\"text\": ...}} (only text is supported), got {short_repr(part)}",
                               field=f"{where}[{j}]")
