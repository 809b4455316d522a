"""Anthropic Message Batches request lines (``{"custom_id", "params"}``, docs/protocol.md) as chat bodies.

:func:`chat_body` maps a line's ``params`` (the Messages API body) onto the chat body that
:mod:`batchinfer.protocol.bodies` validates like any ``/v1/chat/completions`` body: ``system`` and
``messages`` (text, ``tool_use`` and ``tool_result`` blocks) become chat ``messages`` with assistant
``tool_calls`` and ``tool`` messages, ``stop_sequences`` ``stop``, ``tools`` (``input_schema``) and
``tool_choice`` (``auto`` / ``any`` / ``tool`` / ``none``) chat tools. The shape of what only the
Messages API has is checked here; the rest on the chat body, and :func:`anthropic_path` names the
Anthropic field of an error found there. Every error names the path under ``params.``
(``params.messages[2].content[0].type``). A null field is an absent one, as for chat bodies (and
so that the null-filled structs of a Parquet ``params`` column read as the JSON they came from).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from batchinfer.protocol.entries import TEXT_ONLY, RequestError, renamed_path, short_repr

__all__ = ["PARAMS_FIELDS", "anthropic_path", "chat_body"]

_SAME = ("model", "max_tokens", "temperature", "top_p", "top_k", "stream", "service_tier")
PARAMS_FIELDS = (*_SAME, "messages", "system", "stop_sequences", "tools", "tool_choice", "metadata",
                 "thinking")
ROLES = ("user", "assistant")
_BLOCK_KEYS = {"text": ("type", "text", "cache_control", "citations"),
               "tool_use": ("type", "id", "name", "input", "cache_control"),
               "tool_result": ("type", "tool_use_id", "content", "is_error", "cache_control"),
               "thinking": ("type", "thinking", "signature"),
               "redacted_thinking": ("type", "data")}
_NON_TEXT_BLOCKS = ("image", "document", "search_result", "container_upload")
_TOOL_KEYS = ("type", "name", "description", "input_schema", "cache_control")
_CHOICES = {"auto": "auto", "any": "required", "none": "none", "tool": "function"}


def _bad(message: str, path: str) -> RequestError:
    return RequestError("invalid_request", message, field=path)


def _given(obj: Mapping[str, Any]) -> dict[str, Any]:
    """``obj`` without its null fields."""
    return {str(k): v for k, v in obj.items() if v is not None}


def _object(value: Any, path: str, allowed: tuple[str, ...], what: str) -> dict[str, Any]:
    """``value``'s non-null fields, checked to be an object with only ``allowed`` fields."""
    if not isinstance(value, Mapping):
        raise _bad(f"{path} must be an object, got {short_repr(value)}", path)
    given = _given(value)
    unknown = sorted(k for k in given if k not in allowed)
    if unknown:
        raise _bad(f"{path}.{unknown[0]} is not a field of {what} (it takes {', '.join(allowed)})",
                   f"{path}.{unknown[0]}")
    return given


def _string(value: Any, path: str) -> str:
    if not isinstance(value, str):
        raise _bad(f"{path} must be a string, got {short_repr(value)}", path)
    return value


def chat_body(custom_id: Any, params: Any) -> dict[str, Any]:
    """The chat body of an Anthropic line's ``params``, with the line's ``custom_id``."""
    if not isinstance(params, Mapping):
        raise _bad(f"params must be an object (the Messages API request), got {short_repr(params)}", "params")
    given = _given(params)
    unknown = sorted(k for k in given if k not in PARAMS_FIELDS)
    if unknown:
        raise _bad(f"unknown field(s) in Anthropic params: {', '.join(unknown)}", f"params.{unknown[0]}")
    if "max_tokens" not in given:
        raise _bad("params.max_tokens is required (as in the Messages API)", "params.max_tokens")
    out: dict[str, Any] = {k: given[k] for k in _SAME if k in given}
    out["custom_id"] = custom_id
    messages = _system(given["system"]) if "system" in given else []
    if "messages" not in given:
        raise _bad("params.messages is required", "params.messages")
    messages += _messages(given["messages"])
    out["messages"] = messages
    if "stop_sequences" in given:
        out["stop"] = given["stop_sequences"]
    if "tools" in given:
        out["tools"] = _tools(given["tools"])
    if "tool_choice" in given:
        out.update(_tool_choice(given["tool_choice"]))
    if "metadata" in given:
        meta = _object(given["metadata"], "params.metadata", ("user_id",), "metadata")
        if "user_id" in meta:  # kept in the row's metadata (ours is a string map); no other effect
            out["metadata"] = {"user_id": _string(meta["user_id"], "params.metadata.user_id")}
    if "thinking" in given:  # accepted, no effect: the models here do not think apart
        _object(given["thinking"], "params.thinking", ("type", "budget_tokens"), "thinking")
    return out


def _system(value: Any) -> list[dict[str, Any]]:
    if isinstance(value, str):
        return [{"role": "system", "content": value}]
    if not isinstance(value, list):
        raise _bad(f"params.system must be a string or a list of text blocks, got {short_repr(value)}",
                   "params.system")
    parts = [_text_part(block, f"params.system[{j}]") for j, block in enumerate(value)]
    return [{"role": "system", "content": parts}] if parts else []


def _text_part(block: Any, path: str) -> dict[str, str]:
    kind = block.get("type") if isinstance(block, Mapping) else None
    if kind in _NON_TEXT_BLOCKS:
        raise _bad(f"{path}: {kind} blocks are not supported: {TEXT_ONLY}", f"{path}.type")
    if kind != "text":
        raise _bad(f"{path} must be a text block {{\"type\": \"text\", \"text\": ...}}, "
                   f"got {short_repr(block)}",
                   f"{path}.type" if isinstance(block, Mapping) else path)
    given = _object(block, path, _BLOCK_KEYS["text"], "a text block")
    return {"type": "text", "text": _string(given.get("text"), f"{path}.text")}


def _messages(value: Any) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not value:
        raise _bad(f"params.messages must be a non-empty list, got {short_repr(value)}", "params.messages")
    out: list[dict[str, Any]] = []
    for i, m in enumerate(value):
        path = f"params.messages[{i}]"
        given = _object(m, path, ("role", "content"), "a message")
        role = given.get("role")
        if role not in ROLES:
            raise _bad(f"{path}.role must be user or assistant (the system prompt is params.system), got "
                       f"{short_repr(role)}", f"{path}.role")
        content = given.get("content")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
        elif isinstance(content, list) and content:
            out += _assistant(content, path) if role == "assistant" else _user(content, path)
        else:
            raise _bad(f"{path}.content must be a string or a non-empty list of content blocks, got "
                       f"{short_repr(content)}",
                       f"{path}.content")
    return out


def _kind(block: Any, path: str, allowed: tuple[str, ...]) -> str:
    kind = block.get("type") if isinstance(block, Mapping) else None
    if kind in _NON_TEXT_BLOCKS:
        raise _bad(f"{path}: {kind} blocks are not supported: {TEXT_ONLY}", f"{path}.type")
    if kind not in allowed:
        raise _bad(f"{path}.type must be one of {', '.join(allowed)} here, got {short_repr(kind)}",
                   f"{path}.type" if isinstance(block, Mapping) else path)
    return str(kind)


def _user(blocks: list[Any], path: str) -> list[dict[str, Any]]:
    """Text blocks as one user message; each ``tool_result`` as a ``tool`` message, in their order."""
    out: list[dict[str, Any]] = []
    text: list[dict[str, str]] = []
    for j, block in enumerate(blocks):
        where = f"{path}.content[{j}]"
        if _kind(block, where, ("text", "tool_result")) == "text":
            text.append(_text_part(block, where))
            continue
        if text:
            out.append({"role": "user", "content": text})
            text = []
        given = _object(block, where, _BLOCK_KEYS["tool_result"], "a tool_result block")
        if "is_error" in given and not isinstance(given["is_error"], bool):
            raise _bad(f"{where}.is_error must be a boolean, got {short_repr(given['is_error'])}",
                       f"{where}.is_error")
        result = given.get("content", "")
        if not isinstance(result, str):
            if not isinstance(result, list):
                raise _bad(f"{where}.content must be a string or a list of text blocks, "
                           f"got {short_repr(result)}", f"{where}.content")
            result = [_text_part(b, f"{where}.content[{k}]") for k, b in enumerate(result)]
        out.append({"role": "tool", "tool_call_id": _string(given.get("tool_use_id"), f"{where}.tool_use_id"),
                    "content": result})
    if text or not out:
        out.append({"role": "user", "content": text})
    return out


def _assistant(blocks: list[Any], path: str) -> list[dict[str, Any]]:
    """Text blocks as the content, ``tool_use`` blocks as ``tool_calls``; thinking blocks dropped."""
    text: list[dict[str, str]] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(blocks):
        where = f"{path}.content[{j}]"
        kind = _kind(block, where, ("text", "tool_use", "thinking", "redacted_thinking"))
        if kind == "text":
            text.append(_text_part(block, where))
        elif kind == "tool_use":
            given = _object(block, where, _BLOCK_KEYS["tool_use"], "a tool_use block")
            arguments = given.get("input")
            if not isinstance(arguments, Mapping):
                raise _bad(f"{where}.input must be an object (the call's arguments), "
                           f"got {short_repr(arguments)}", f"{where}.input")
            calls.append({"id": _string(given.get("id"), f"{where}.id"), "type": "function",
                          "function": {"name": _string(given.get("name"), f"{where}.name"),
                                       "arguments": json.dumps(arguments, ensure_ascii=False)}})
        else:  # an earlier turn's thinking: no model here reads it back
            _object(block, where, _BLOCK_KEYS[kind], f"a {kind} block")
    message: dict[str, Any] = {"role": "assistant", "content": text if text or not calls else None}
    if calls:
        message["tool_calls"] = calls
    return [message]


def _tools(value: Any) -> Any:
    """``{name, description, input_schema}`` tools as chat function tools."""
    if not isinstance(value, list):
        return value  # parse_tools names the field
    out = []
    for i, tool in enumerate(value):
        path = f"params.tools[{i}]"
        kind = tool.get("type") if isinstance(tool, Mapping) else None
        if kind not in (None, "custom"):
            raise _bad(f"{path}.type {short_repr(kind)} is not available here: only client tools {{name, "
                       "description, input_schema}} (server tools run on Anthropic's side)", f"{path}.type")
        given = _object(tool, path, _TOOL_KEYS, "a tool")
        if "input_schema" not in given:
            raise _bad(f"{path}.input_schema is required (the JSON schema of the tool's input)",
                       f"{path}.input_schema")
        function = {"name": given.get("name"), "parameters": given["input_schema"]}
        if "description" in given:
            function["description"] = given["description"]
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(value: Any) -> dict[str, Any]:
    """``{type: auto|any|tool|none, name?, disable_parallel_tool_use?}`` as chat ``tool_choice`` and
    ``parallel_tool_calls``."""
    given = _object(value, "params.tool_choice", ("type", "name", "disable_parallel_tool_use"), "tool_choice")
    kind = given.get("type")
    if kind not in _CHOICES:
        raise _bad(f"params.tool_choice.type must be one of {', '.join(_CHOICES)}, got {short_repr(kind)}",
                   "params.tool_choice.type")
    if kind == "tool":
        choice: Any = {"type": "function", "function": {"name": _string(given.get("name"),
                                                                         "params.tool_choice.name")}}
    elif "name" in given:
        raise _bad(f"params.tool_choice.name is only for type \"tool\", not {kind!r}",
                   "params.tool_choice.name")
    else:
        choice = _CHOICES[kind]
    out: dict[str, Any] = {"tool_choice": choice}
    disable = given.get("disable_parallel_tool_use")
    if disable is not None:
        if not isinstance(disable, bool):
            raise _bad("params.tool_choice.disable_parallel_tool_use must be a boolean, got "
                       f"{short_repr(disable)}",
                       "params.tool_choice.disable_parallel_tool_use")
        out["parallel_tool_calls"] = not disable
    return out


# -- errors found on the chat body -------------------------------------------------------------------

_RENAMES: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"^stop(?=\[|$)"), "stop_sequences"),
    (re.compile(r"^messages.*"), "messages"),
    (re.compile(r"^tools\[(\d+)\]\.function\.parameters"), r"tools[\1].input_schema"),
    (re.compile(r"^tools\[(\d+)\]\.function"), r"tools[\1]"),
    (re.compile(r"^tool_choice.*"), "tool_choice"),
    (re.compile(r"^parallel_tool_calls"), "tool_choice.disable_parallel_tool_use"),
)


def anthropic_path(chat_field: str) -> str:
    """The ``params.`` path of the Anthropic field that chat body field ``chat_field`` came from."""
    return renamed_path(chat_field, _RENAMES, "params")
