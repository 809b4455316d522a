"""OpenAI batch output lines (``--format openai``): one result row, one line of OpenAI's output file.

A line is ``{"id": "batch_req_<32 hex>", "custom_id", "response": {"status_code": 200,
"request_id", "body"}, "error": null}``; ``body`` is what the row's endpoint (``url``) answers:
a ``chat.completion`` (``/v1/chat/completions``, and ``/v1/messages`` lines, which are chat), a
``text_completion`` (``/v1/completions`` and plain bodies), an embeddings ``list`` (a row with
vectors) or a ``response`` object (``/v1/responses``). A row that did not complete gets
``"response": null, "error": {"code", "message", "line"}``. docs/results.md shows each shape; the
``openai`` package's models (``ChatCompletion``, ``Completion``, ``CreateEmbeddingResponse``,
``Response``) parse them (tests/test_openai_lines.py).
"""

from __future__ import annotations

import base64
import datetime as dt
import decimal
import json
import math
from collections.abc import Mapping
from typing import Any

from batchinfer.jobs.row_views import (
    compact,
    completions,
    error_message,
    opaque_id,
    sampling_params,
    seconds,
    system_fingerprint,
)
from batchinfer.jobs.vectors import decoded_vectors

CHAT_URLS = ("/v1/chat/completions", "/v1/messages")
RESPONSES_URL = "/v1/responses"
EMBEDDINGS_URL = "/v1/embeddings"

# OpenAI's codes for requests a batch never ran, keyed by a row's status (a foreign row may lack one)
_ERROR_CODES: dict[str | None, str] = {"cancelled": "batch_cancelled", "expired": "batch_expired"}
#: A row dict's key for the kept input columns the export joined to it (name -> value, as pyarrow's
#: ``to_pylist`` gives them); no protocol field starts with ``__``.
KEPT_KEY = "__kept"


def json_value(value: Any) -> Any:
    """A kept value as JSON: dates and times as ISO text, decimals as their exact text, bytes as
    base64, durations in seconds, NaN and infinities as null; lists and structs item by item."""
    if isinstance(value, (dt.date, dt.time)):  # datetime is a date
        return value.isoformat()
    if isinstance(value, dt.timedelta):
        return value.total_seconds()
    if isinstance(value, decimal.Decimal):
        return str(value)
    if isinstance(value, (bytes, bytearray)):
        return base64.b64encode(value).decode()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Mapping):
        return {str(k): json_value(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_value(v) for v in value]
    return value


def kept_json(row: Mapping[str, Any]) -> dict[str, Any] | None:
    """The row's kept columns as a JSON object (None: the job kept none)."""
    kept = row.get(KEPT_KEY)
    return None if kept is None else {k: json_value(v) for k, v in kept.items()}


def openai_line(row: Mapping[str, Any]) -> str:
    """One line of the OpenAI batch output format: ``id``, ``custom_id``, ``response``, ``error``.

    Ids are opaque and stable (``batch_req_`` and 32 hex characters of the request id: no colon,
    the same in every export of the row); ``response.request_id`` is the same token. A row with kept
    input columns gets them as a ``metadata`` object (:func:`kept_json`).
    """
    token = opaque_id("batch_req", row.get("request_id"))
    out: dict[str, Any] = {"id": f"batch_req_{token}", "custom_id": row.get("custom_id"),
                           "response": None, "error": None}
    status = row.get("status")
    if status == "completed":
        out["response"] = {"status_code": 200, "request_id": token, "body": openai_body(row)}
    else:
        code = _ERROR_CODES.get(status) or row.get("error_code") or status
        out["error"] = {"code": code, "message": error_message(row), "line": row.get("line")}
    kept = kept_json(row)
    if kept is not None:
        out["metadata"] = kept
    return compact(out)


def endpoint(row: Mapping[str, Any]) -> str | None:
    """The OpenAI endpoint a row answers (its line's ``url``); None for a plain body."""
    return row.get("url") or row.get("endpoint")


def openai_body(row: Mapping[str, Any]) -> dict[str, Any]:
    """The response body of a completed row, by its endpoint."""
    url = endpoint(row)
    if row.get("embeddings") is not None or url == EMBEDDINGS_URL:
        return _embeddings(row)
    if url == RESPONSES_URL:
        return _response(row)
    return _completion(row, chat=url in CHAT_URLS)


def _usage(row: Mapping[str, Any]) -> dict[str, Any]:
    prompt, completion = row.get("prompt_tokens") or 0, row.get("completion_tokens") or 0
    # a request without a prediction (null counts) kept and rejected none of it
    accepted = row.get("accepted_prediction_tokens") or 0
    rejected = row.get("rejected_prediction_tokens") or 0
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": row.get("cached_tokens") or 0, "audio_tokens": 0},
            # nothing here reasons or speaks: OpenAI's zeros, not absent keys
            "completion_tokens_details": {"reasoning_tokens": 0, "accepted_prediction_tokens": accepted,
                                          "rejected_prediction_tokens": rejected, "audio_tokens": 0}}


def _created(row: Mapping[str, Any]) -> int:
    """When the completion was made (unix seconds): the row's end, else its start, else 0."""
    for name in ("finished_at", "started_at", "created_at"):
        value = seconds(row.get(name))
        if value is not None:
            return value
    return 0


def _completion(row: Mapping[str, Any], chat: bool) -> dict[str, Any]:
    """A ``chat.completion`` or ``text_completion`` object with every completion (``n``) as a choice."""
    choices = []
    for i, c in enumerate(completions(row)):
        choice: dict[str, Any] = {"index": c.get("index", i)}
        text, calls = c.get("text") or "", c["tool_calls"]
        if chat:
            # a completion of calls only has null content, as OpenAI writes it
            message: dict[str, Any] = {"role": "assistant", "content": text if text or not calls else None,
                                       "refusal": None, "annotations": []}
            if calls:
                message["tool_calls"] = [_call(call) for call in calls]
            choice["message"] = message
        else:
            choice["text"] = text
        choice["logprobs"] = _logprobs(c.get("logprobs"), chat)
        choice["finish_reason"] = c["finish_reason"]
        choices.append(choice)
    kind = "chatcmpl" if chat else "cmpl"
    out = {
        "id": f"{kind}-{opaque_id(kind, row.get('request_id'))}",
        "object": "chat.completion" if chat else "text_completion",
        "created": _created(row),
        "model": row.get("model"),
        "choices": choices,
        "usage": _usage(row),
        "system_fingerprint": system_fingerprint(row.get("model")),
    }
    if chat:  # a chat completion says its tier (a text completion has no such field)
        out["service_tier"] = "default"
    return out


def _call(call: Mapping[str, Any]) -> dict[str, Any]:
    """A tool call in OpenAI's shape (keys in OpenAI's order; nothing else the row may hold)."""
    function = call.get("function") or {}
    return {"id": call.get("id"), "type": call.get("type") or "function",
            "function": {"name": function.get("name"), "arguments": function.get("arguments")}}


def _embeddings(row: Mapping[str, Any]) -> dict[str, Any]:
    """OpenAI's embeddings response: one ``data`` item per input, floats, or the row's own base64
    float32 text when the request asked ``encoding_format: "base64"`` (OpenAI's base64 is that)."""
    params = row.get("pooling_params")
    if isinstance(params, str):
        params = json.loads(params)
    as_text = isinstance(params, Mapping) and params.get("encoding_format") == "base64"
    texts = row.get("embeddings") or []
    vectors = texts if as_text else decoded_vectors(row) or []
    prompt = row.get("prompt_tokens") or 0
    return {"object": "list",
            "data": [{"object": "embedding", "index": i, "embedding": v} for i, v in enumerate(vectors)],
            "model": row.get("model"), "usage": {"prompt_tokens": prompt, "total_tokens": prompt}}


def _logprobs(steps: Any, chat: bool) -> dict[str, Any] | None:
    """A choice's ``logprobs`` in OpenAI's shape: chat ``{content: [...], refusal}``, completions
    ``{tokens, token_logprobs, top_logprobs, text_offset}``; None when not asked for (or rows of the
    earlier ``{"<token id>": logprob}`` form, which hold no token text)."""
    if not _has_logprobs(steps):
        return None
    if chat:
        return {"content": _token_logprobs(steps), "refusal": None}
    tokens = [s.get("token") or "" for s in steps]
    offsets, at = [], 0
    for t in tokens:  # offsets into the completion's text, as vLLM counts them (no echo of the prompt)
        offsets.append(at)
        at += len(t)
    tops = []
    for s in steps:
        # OpenAI: the top `logprobs` tokens and always the sampled one (so up to logprobs + 1)
        top: dict[str, float] = {}
        for e in [*(s.get("top_logprobs") or ()), s]:
            top.setdefault(e.get("token") or "", e.get("logprob"))
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": [s.get("logprob") for s in steps], "top_logprobs": tops,
            "text_offset": offsets}


def _has_logprobs(steps: Any) -> bool:
    return steps is not None and all(isinstance(s, Mapping) and "logprob" in s for s in steps)


def _token_logprobs(steps: Any) -> list[dict[str, Any]]:
    """Chat's (and the Responses API's) per-token list: token, logprob, bytes, top_logprobs."""
    def token(e: Mapping[str, Any]) -> dict[str, Any]:
        raw = e.get("bytes")
        return {"token": e.get("token"), "logprob": e.get("logprob"),
                "bytes": None if raw is None else list(raw)}

    return [{**token(s), "top_logprobs": [token(t) for t in s.get("top_logprobs") or ()]} for s in steps]


# -- /v1/responses ---------------------------------------------------------------------------------


def _response(row: Mapping[str, Any]) -> dict[str, Any]:
    """A Responses API ``response`` object: the first completion as a ``message`` output item (its
    text) and ``function_call`` items (its tool calls); ``incomplete`` when ``max_output_tokens``
    cut it."""
    first = completions(row)[0]
    request_id = row.get("request_id")
    incomplete = first["finish_reason"] == "length"
    state = "incomplete" if incomplete else "completed"
    text, calls = first.get("text") or "", first["tool_calls"] or []
    output: list[dict[str, Any]] = []
    if text or not calls:
        content: dict[str, Any] = {"type": "output_text", "text": text, "annotations": []}
        if _has_logprobs(first.get("logprobs")):
            content["logprobs"] = _token_logprobs(first["logprobs"])
        output.append({"type": "message", "id": f"msg_{opaque_id('msg', request_id)}", "role": "assistant",
                       "status": state, "content": [content]})
    for call in calls:
        function = call.get("function") or {}
        output.append({"type": "function_call", "id": f"fc_{opaque_id('fc', call.get('id'))}",
                       "call_id": call.get("id"), "name": function.get("name"),
                       "arguments": function.get("arguments"), "status": "completed"})
    usage = _usage(row)
    params = sampling_params(row)
    tools, tool_choice, parallel = _response_tools(row.get("tools"))
    return {
        "id": f"resp_{opaque_id('resp', request_id)}",
        "object": "response",
        "created_at": seconds(row.get("created_at")) or _created(row),
        "status": state,
        "completed_at": None if incomplete else _created(row),
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "instructions": None,
        "max_output_tokens": params.get("max_tokens"),
        "model": row.get("model"),
        "output": output,
        "parallel_tool_calls": parallel,
        "previous_response_id": None,
        "reasoning": {"effort": None, "summary": None},
        "service_tier": "default",
        "temperature": _number(params.get("temperature")),
        "text": {"format": {"type": "text"}},
        "tool_choice": tool_choice,
        "tools": tools,
        "top_p": _number(params.get("top_p")),
        "truncation": "disabled",
        "usage": {"input_tokens": usage["prompt_tokens"],
                  "input_tokens_details": {"cached_tokens": usage["prompt_tokens_details"]["cached_tokens"],
                                           "cache_write_tokens": 0},
                  "output_tokens": usage["completion_tokens"],
                  "output_tokens_details": {"reasoning_tokens": 0},
                  "total_tokens": usage["total_tokens"]},
        "user": None,
        "metadata": dict(row.get("metadata") or {}),
    }


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _response_tools(spec: Any) -> tuple[list[dict[str, Any]], Any, bool]:
    """``tools``, ``tool_choice``, ``parallel_tool_calls`` of a Response from the request's tool spec
    (``ToolSpec.to_dict()``), when the row carries it; else none, ``auto``, true (OpenAI's defaults)."""
    if not isinstance(spec, Mapping):
        return [], "auto", True
    tools = []
    for tool in spec.get("tools") or ():
        function = tool.get("function") or {}
        tools.append({"type": "function", "name": function.get("name"),
                      "description": function.get("description"),
                      "parameters": function.get("parameters"), "strict": function.get("strict")})
    choice = spec.get("choice") or "auto"
    tool_choice: Any = {"type": "function", "name": spec.get("function")} if choice == "function" else choice
    return tools, tool_choice, bool(spec.get("parallel", True))
