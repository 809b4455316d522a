"""Validation of request bodies (docs/protocol.md): plain bodies, OpenAI Batch lines (chat,
completions, embeddings, responses) and Anthropic Message Batches lines become a :class:`RequestSpec`,
with OpenAI names mapped and unknown fields rejected by name. Responses bodies and Anthropic
``params`` are first mapped onto chat bodies (:mod:`batchinfer.protocol.responses_in`,
:mod:`batchinfer.protocol.anthropic_in`); tools are checked by :func:`batchinfer.workers.tools.parse_tools`.

Bodies are validated once, in the scheduler's intake, through :func:`parse_body`; every problem is a
:class:`~batchinfer.protocol.entries.RequestError` naming the field (and the input line when known), which the
intake turns into an error row. Nothing here touches Redis.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from batchinfer.protocol import anthropic_in, compact_json, responses_in
from batchinfer.protocol.chat_messages import check_content, check_messages
from batchinfer.protocol.embed_bodies import EmbedInputs, check_embed_fields, parse_inputs, parse_pooling
from batchinfer.protocol.entries import (
    ANTHROPIC_LINE_FIELDS,
    CHAT_URL,
    COMPLETIONS_URL,
    EMBEDDINGS_URL,
    IGNORED_OPENAI_FIELDS,
    MAX_CUSTOM_ID_CHARS,
    MESSAGES_URL,
    OPENAI_LINE_FIELDS,
    REQUEST_FIELDS,
    RESPONSES_URL,
    TOOL_FIELDS,
    RequestError,
    kind_name,
    short_repr,
)
from batchinfer.protocol.structured_bodies import pop_structured, reject_for_embeddings
from batchinfer.workers.pooling_params import PoolingParams
from batchinfer.workers.sampling_params import SamplingParams
from batchinfer.workers.tools.spec import ToolSpec, parse_tools

__all__ = ["RequestSpec", "custom_id_of", "leading_custom_id", "parse_body"]


@dataclass
class RequestSpec:
    """A validated request body: exactly one of ``prompt`` / ``prompt_token_ids`` / ``messages``, or
    for ``task == "embed"`` the ``inputs`` (texts or token-id lists) and their ``pooling_params``
    (``sampling_params`` is then the unused default)."""

    sampling_params: SamplingParams
    custom_id: str | None = None
    model: str | None = None  # None: the job's model
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    messages: list[dict[str, Any]] | None = None
    priority: int = 0
    metadata: dict[str, str] = field(default_factory=dict)
    url: str | None = None  # the OpenAI endpoint of an OpenAI Batch line
    task: str = "generate"  # "generate" | "embed"
    inputs: EmbedInputs | None = None
    pooling_params: PoolingParams | None = None
    # The body path of the output constraint's spec (e.g. "response_format.json_schema.schema"), which
    # the scheduler's compile check names; None when sampling_params.structured_outputs is None.
    structured_field: str | None = None
    tools: dict[str, Any] | None = None  # ToolSpec.to_dict() of a chat body's tools; None: no tools
    # OpenAI's predicted output (chat `prediction`), kept for speculative decoding; changes no output
    prediction: str | None = None


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not a valid JSON number")


# A \uD800-\uDFFF escape: valid JSON, but alone (not in a pair) it decodes to a string that is not
# Unicode, which no tokenizer, row or Redis write can encode.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def _check_unicode(value: Any, where: str) -> None:
    """Raise ``invalid_json`` naming the first string (key or value) holding a lone surrogate."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise RequestError("invalid_json", f"{where} holds a lone UTF-16 surrogate escape (\\ud800-"
                               "\\udfff without its pair), which is not Unicode", field=where) from None
    elif isinstance(value, dict):
        for k, v in value.items():
            _check_unicode(k, f"{where} key")
            _check_unicode(v, k if where == "body" else f"{where}.{k}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _check_unicode(v, f"{where}[{i}]")


def parse_body(body: str | bytes | Mapping[str, Any], *, line: int | None = None,
               max_tokens_limit: int | None = None) -> RequestSpec:
    """Validate one request body or OpenAI Batch line; raises only :class:`RequestError`.

    OpenAI Batch lines (``custom_id``, ``method``, ``url``, ``body``) are mapped onto the plain body
    (a ``/v1/responses`` body onto a chat body), as are Anthropic Message Batches lines (``custom_id``,
    ``params``); OpenAI names are translated (``max_completion_tokens`` -> ``max_tokens``, chat ``logprobs`` +
    ``top_logprobs`` -> ``logprobs``; ``response_format`` / ``structured_outputs`` / ``guided_*`` ->
    ``structured_outputs``, :mod:`batchinfer.protocol.structured_bodies`). Unknown fields are rejected
    by name. ``max_tokens`` defaults to 16 for prompts (as ``/v1/completions``) and to the rest of the
    context for chat messages.
    """
    try:
        return _parse(body, max_tokens_limit)
    except RequestError as e:
        raise e.at_line(line) from None
    except RecursionError:
        raise RequestError("invalid_json", "body is nested too deeply", line=line) from None


def _parse(body: str | bytes | Mapping[str, Any], max_tokens_limit: int | None) -> RequestSpec:
    if isinstance(body, (bytes, bytearray)):
        try:  # json.loads would guess UTF-16/32 from the first bytes; the protocol says UTF-8
            body = bytes(body).decode("utf-8")
        except UnicodeDecodeError as e:
            raise RequestError("invalid_json", f"body is not UTF-8: {e}") from None
    if isinstance(body, str):
        text = body
        # orjson reads nesting that json refuses (RecursionError: "nested too deeply"); a body with
        # fewer brackets than that cannot hold it, and others (huge chats) take json's path whole
        read = compact_json.loads if text.count("[") + text.count("{") < FEW_BRACKETS else json.loads
        try:
            body = read(text, parse_constant=_reject_constant)
        except json.JSONDecodeError as e:
            # json counts lines of the body; the row's `line` column is the file's line
            where = f"column {e.colno}" if e.lineno == 1 else f"line {e.lineno} of the body, column {e.colno}"
            raise RequestError("invalid_json", f"invalid JSON: {e.msg} ({where})") from None
        except ValueError as e:  # too-long integers, NaN / Infinity
            raise RequestError("invalid_json", f"invalid JSON: {e}") from None
        if "\\u" in text and _SURROGATE_ESCAPE.search(text):
            _check_unicode(body, "body")
    if not isinstance(body, Mapping):
        raise RequestError("invalid_request", f"body must be a JSON object, got {kind_name(body)}")
    try:
        if any(k in body for k in ("method", "url", "body")):
            return _parse_openai_line(body, max_tokens_limit)
        if "params" in body:
            return _parse_anthropic_line(body, max_tokens_limit)
        return _parse_plain(dict(body), url=None, max_tokens_limit=max_tokens_limit)
    except RequestError as e:
        # so that the error row still carries the caller's id, as OpenAI's batch errors do
        if isinstance(body.get("custom_id"), str) and len(body["custom_id"]) <= MAX_CUSTOM_ID_CHARS:
            e.context.setdefault("custom_id", body["custom_id"])
        raise


def _parse_openai_line(line: Mapping[str, Any], max_tokens_limit: int | None) -> RequestSpec:
    unknown = sorted(str(k) for k in line if k not in OPENAI_LINE_FIELDS)
    if unknown:
        raise RequestError("invalid_request", f"unknown field(s) in OpenAI Batch line: {', '.join(unknown)}",
                           field=unknown[0])
    for name in OPENAI_LINE_FIELDS:
        if name not in line:
            raise RequestError("invalid_request", f"OpenAI Batch line is missing '{name}'", field=name)
    method = line["method"]
    if not isinstance(method, str) or method.upper() != "POST":
        raise RequestError("invalid_request", f"method must be \"POST\", got {method!r}", field="method")
    url = line["url"]
    if url not in (CHAT_URL, COMPLETIONS_URL, EMBEDDINGS_URL, RESPONSES_URL):
        raise RequestError("unsupported_url", f"url {url!r} is not supported (use {CHAT_URL}, "
                           f"{COMPLETIONS_URL}, {EMBEDDINGS_URL} or {RESPONSES_URL})", field="url")
    inner = line["body"]
    if not isinstance(inner, Mapping):
        raise RequestError("invalid_request", f"body must be an object, got {kind_name(inner)}", field="body")
    inner = dict(inner)
    if "custom_id" in inner:
        raise RequestError("invalid_request", "custom_id belongs to the Batch line, not to its body",
                           field="body.custom_id")
    inner["custom_id"] = line["custom_id"]
    if url == RESPONSES_URL:
        chat = responses_in.chat_body(inner)
        return _mapped(chat, RESPONSES_URL, max_tokens_limit, responses_in.responses_path)
    if url == EMBEDDINGS_URL:
        if "input" not in inner:
            raise RequestError("invalid_request", f"{EMBEDDINGS_URL} needs 'input'", field="body.input")
        return _parse_plain(inner, url=url, max_tokens_limit=max_tokens_limit)
    if "input" in inner:
        raise RequestError("invalid_request", f"input is for {EMBEDDINGS_URL}; {url} takes "
                           f"{'messages' if url == CHAT_URL else 'prompt'}", field="body.input")
    if url == CHAT_URL:
        if "prompt" in inner or "prompt_token_ids" in inner:
            raise RequestError("invalid_request", f"{CHAT_URL} takes 'messages', not a prompt",
                               field="body.prompt")
        if "messages" not in inner:
            raise RequestError("invalid_request", f"{CHAT_URL} needs 'messages'", field="body.messages")
        _map_chat_logprobs(inner)
    else:
        if "messages" in inner:
            raise RequestError("invalid_request", f"{COMPLETIONS_URL} takes 'prompt', not 'messages'",
                               field="body.messages")
        # Accepted only with values that change nothing (``True == 1`` in Python: compare by identity).
        for name, harmless in (("echo", (None, False)), ("suffix", (None,)), ("best_of", (None, 1))):
            value = inner.pop(name, None)
            if not any(value is h or (_is_int(value) and value == h) for h in harmless):
                raise RequestError("invalid_request", f"{name} is not supported", field=f"body.{name}")
    return _parse_plain(inner, url=url, max_tokens_limit=max_tokens_limit)


def _parse_anthropic_line(line: Mapping[str, Any], max_tokens_limit: int | None) -> RequestSpec:
    unknown = sorted(str(k) for k in line if k not in ANTHROPIC_LINE_FIELDS)
    if unknown:
        raise RequestError("invalid_request", f"unknown field(s) in Anthropic Message Batches line: "
                           f"{', '.join(unknown)}", field=unknown[0])
    if "custom_id" not in line:
        raise RequestError("invalid_request", "Anthropic Message Batches line is missing 'custom_id'",
                           field="custom_id")
    chat = anthropic_in.chat_body(line["custom_id"], line["params"])
    return _mapped(chat, MESSAGES_URL, max_tokens_limit, anthropic_in.anthropic_path)


def _mapped(chat: dict[str, Any], url: str, max_tokens_limit: int | None,
            path_of: Callable[[str], str]) -> RequestSpec:
    """The spec of a chat body mapped from another API; an error, and the constraint's field that the
    scheduler's compile check names, name that API's field (``path_of``)."""
    try:
        spec = _parse_plain(chat, url=url, max_tokens_limit=max_tokens_limit)
    except RequestError as e:
        if e.field is not None and e.field != "custom_id":
            renamed = path_of(e.field)
            if e.message.startswith(e.field):
                e.message = renamed + e.message[len(e.field):]
            e.field = renamed
        raise
    if spec.structured_field is not None:
        spec.structured_field = path_of(spec.structured_field)
    return spec


def _map_chat_logprobs(body: dict[str, Any]) -> None:
    """Chat: ``logprobs`` is a boolean and ``top_logprobs`` the count; ours is one integer."""
    want = body.pop("logprobs", None)
    top = body.pop("top_logprobs", None)
    if want not in (None, True, False):
        raise RequestError("invalid_request", f"logprobs must be a boolean for {CHAT_URL}, got {want!r}",
                           field="logprobs")
    if top is not None and not want:
        raise RequestError("invalid_request", "top_logprobs needs logprobs: true", field="top_logprobs")
    if want:
        body["logprobs"] = 0 if top is None else top


def _parse_plain(body: dict[str, Any], url: str | None, max_tokens_limit: int | None) -> RequestSpec:
    body = {str(k): v for k, v in body.items()}
    stream = body.pop("stream", None)
    if stream not in (None, False):
        raise RequestError("invalid_request", "stream: true is not supported in batch requests",
                           field="stream")
    _pop_ignored(body)
    embed = "input" in body
    structured_field = None
    tool_fields: dict[str, Any] = {}
    extras: dict[str, Any] = {}
    if embed:
        reject_for_embeddings(body, url or "an embeddings request")
        check_embed_fields(body, url or "an embeddings request")
    else:  # response_format / structured_outputs / guided_*: one StructuredOutputsParams
        structured, structured_field = pop_structured(body)
        if structured is not None:
            body["structured_outputs"] = structured
        tool_fields = {name: body.pop(name) for name in TOOL_FIELDS if name in body}
        extras = {name: body.pop(name) for name in ("prediction", "modalities", "audio") if name in body}
    if "max_completion_tokens" in body:
        value = body.pop("max_completion_tokens")
        if body.get("max_tokens") is not None and value is not None and body["max_tokens"] != value:
            raise RequestError("invalid_request", "give one of max_tokens and max_completion_tokens",
                               field="max_completion_tokens")
        body["max_tokens"] = value if value is not None else body.get("max_tokens")
    # output_kind is the in-process engine's knob (LLM sets it): a queued request's row is its final
    # output whatever it says, and the worker runs every request final_only.
    unknown = sorted(k for k in body if k not in REQUEST_FIELDS
                     and (k not in SamplingParams.FIELDS or k == "output_kind"))
    if unknown and not embed:
        raise RequestError("invalid_request", f"unknown field(s): {', '.join(unknown)}", field=unknown[0])

    custom_id = body.pop("custom_id", None)
    if custom_id is not None and (not isinstance(custom_id, str) or len(custom_id) > MAX_CUSTOM_ID_CHARS):
        raise RequestError("invalid_request", f"custom_id must be a string of at most "
                           f"{MAX_CUSTOM_ID_CHARS} characters, "
                           f"got {short_repr(custom_id)}", field="custom_id")
    model = body.pop("model", None)
    if model is not None and (not isinstance(model, str) or not model.strip()):
        raise RequestError("invalid_request", f"model must be a non-empty string, got {short_repr(model)}",
                           field="model")
    priority = body.pop("priority", None)
    if priority is None:
        priority = 0
    elif not _is_int(priority) or abs(priority) > 2**31:
        raise RequestError("invalid_request", f"priority must be an integer, got {short_repr(priority)}",
                           field="priority")
    metadata = _metadata(body.pop("metadata", None))
    if embed:
        return RequestSpec(sampling_params=SamplingParams(), custom_id=custom_id, model=model,
                           priority=priority, metadata=metadata, url=url, task="embed",
                           inputs=parse_inputs(body.pop("input")), pooling_params=parse_pooling(body))
    prompt, token_ids, messages = _inputs(body)
    if messages is not None and "max_tokens" not in body:
        body["max_tokens"] = None  # chat: until the context is full
    tools = _tools(tool_fields, messages is not None, "structured_outputs" in body)
    if tools is not None and (constraint := tools.call_constraint()) is not None:
        body["structured_outputs"] = constraint  # required / a named function: the call is forced
        structured_field = "tools"
    prediction = _output_options(extras, messages is not None)
    if prediction is not None:  # the engine's speculative decoder drafts from it
        body["prediction"] = prediction
    try:
        params = SamplingParams.from_dict(body)
    except (ValueError, TypeError, OverflowError) as e:
        # SamplingParams messages start with the field's name, e.g. "stop[1] must be a string".
        first = str(e).split(" ", 1)[0]
        fld = first if first.split("[", 1)[0] in body else None
        raise RequestError("invalid_request", str(e), field=fld) from None
    limit = max_tokens_limit
    if limit is not None and params.max_tokens is not None and params.max_tokens > limit:
        raise RequestError("invalid_request", f"max_tokens must be <= {limit}, got "
                           f"{params.max_tokens}", field="max_tokens")
    return RequestSpec(sampling_params=params, custom_id=custom_id, model=model, prompt=prompt,
                       prompt_token_ids=token_ids, messages=messages, priority=priority,
                       metadata=metadata, url=url, structured_field=structured_field,
                       tools=tools.to_dict() if tools is not None else None, prediction=prediction)


def _pop_ignored(body: dict[str, Any]) -> None:
    """Remove the OpenAI fields that change nothing here, once their type is checked."""
    for name, kind in IGNORED_OPENAI_FIELDS.items():
        value = body.pop(name, None)
        if value is not None and not (isinstance(value, kind) and (kind is not str or value)):
            raise RequestError("invalid_request", f"{name} must be {_KIND_NAMES[kind]}, "
                               f"got {short_repr(value)} (accepted, with no effect here)", field=name)


_KIND_NAMES = {str: "a non-empty string", bool: "a boolean", dict: "an object"}


def _tools(given: dict[str, Any], chat: bool, constrained: bool) -> ToolSpec | None:
    """The chat body's tools (:func:`parse_tools`); None without tools."""
    present = [name for name in TOOL_FIELDS if given.get(name) is not None]
    if not present:
        return None
    if not chat:
        raise RequestError("invalid_request", f"{present[0]} is for chat messages: a completions request "
                           "(prompt) cannot call tools", field=present[0])
    try:
        spec = parse_tools(given.get("tools"), given.get("tool_choice"), given.get("parallel_tool_calls"))
    except ValueError as e:  # its message starts with the field's path
        message = str(e)
        raise RequestError("invalid_request", message, field=message.split(":", 1)[0]) from None
    if spec is not None and spec.choice in ("required", "function") and constrained:
        what = "a named function" if spec.function else "required"
        raise RequestError("invalid_request", f"tool_choice: {what} constrains the output to tool calls, and "
                           "response_format / structured_outputs / guided_* constrain it too: give one of "
                           "them", field="tool_choice")
    return spec


def _output_options(given: dict[str, Any], chat: bool) -> str | None:
    """``modalities`` (text only), ``audio`` (refused) and ``prediction``'s text (chat only)."""
    modalities = given.get("modalities")
    if modalities is not None and modalities != ["text"]:
        raise RequestError("invalid_request", f"modalities {short_repr(modalities)} is not supported: "
                           "this model writes text only (give [\"text\"] or leave it out)",
                           field="modalities")
    if given.get("audio") is not None:
        raise RequestError("invalid_request", "audio output is not supported: this model writes text only",
                           field="audio")
    prediction = given.get("prediction")
    if prediction is None:
        return None
    if not chat:
        raise RequestError("invalid_request", "prediction is for chat messages (as OpenAI's)",
                           field="prediction")
    if not isinstance(prediction, Mapping) or prediction.get("type") != "content" or set(prediction) - {
            "type", "content"}:
        raise RequestError("invalid_request", f"prediction must be {{\"type\": \"content\", \"content\": "
                           f"...}}, got {short_repr(prediction)}", field="prediction")
    content = prediction.get("content")
    if isinstance(content, str):
        return content
    check_content(content, "prediction.content", False)
    return "".join(part["text"] for part in content or ())


def _inputs(body: dict[str, Any]) -> tuple[str | None, list[int] | None, list[dict] | None]:
    given = [k for k in ("prompt", "prompt_token_ids", "messages") if body.get(k) is not None]
    if len(given) != 1:
        what = "none" if not given else ", ".join(given)
        raise RequestError("invalid_request", f"give exactly one of prompt, prompt_token_ids, messages "
                           f"(got {what})", field=given[1] if len(given) > 1 else "prompt")
    for k in ("prompt", "prompt_token_ids", "messages"):
        if k not in given:
            body.pop(k, None)  # an explicit null
    name = given[0]
    value = body.pop(name)
    if name == "prompt":
        # OpenAI completions also accept a one-element list, or a list of token ids.
        if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str):
            value = value[0]
        elif isinstance(value, list) and value and all(_is_int(t) for t in value):
            return None, _token_ids(value, "prompt"), None
        if not isinstance(value, str):
            raise RequestError("invalid_request", f"prompt must be a string (one prompt per request), got "
                               f"{short_repr(value)}", field="prompt")
        if not value:
            raise RequestError("invalid_request", "prompt must not be empty", field="prompt")
        return value, None, None
    if name == "prompt_token_ids":
        return None, _token_ids(value, "prompt_token_ids"), None
    return None, None, check_messages(value)


def _token_ids(value: Any, name: str) -> list[int]:
    if not isinstance(value, list) or not value:
        raise RequestError("invalid_request", f"{name} must be a non-empty list of integers, got "
                           f"{short_repr(value)}", field=name)
    # the usual case checked at C speed (every request of every job passes here); a list that fails
    # it is walked for the first bad element, to name it
    if set(map(type, value)) != _INT_ONLY or min(value) < 0 or max(value) >= 2**31:
        for i, t in enumerate(value):
            if not _is_int(t) or t < 0 or t >= 2**31:
                raise RequestError("invalid_request", f"{name}[{i}] must be a token id (integer >= 0), "
                                   f"got {short_repr(t)}", field=f"{name}[{i}]")
    return list(value)


def _metadata(value: Any) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise RequestError("invalid_request", f"metadata must be an object of strings, "
                           f"got {kind_name(value)}", field="metadata")
    for k, v in value.items():
        if not isinstance(v, str):
            raise RequestError("invalid_request", f"metadata.{k} must be a string, got {short_repr(v)}",
                               field=f"metadata.{k}")
    return {str(k): v for k, v in value.items()}


_INT_ONLY = {int}
FEW_BRACKETS = 512  # a body with fewer '[' and '{' nests less deep than json.loads can read


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# -- custom_id without parsing the whole body -------------------------------------------------------

_CUSTOM_ID_FIRST = re.compile(r'\s*\{\s*"custom_id"\s*:\s*')
_DECODER = json.JSONDecoder()


def leading_custom_id(body: str) -> str | None:
    """The ``custom_id`` of a JSON object whose first key it is (decodes that one string only, so it
    is cheap whatever the body's size), else None."""
    first = _CUSTOM_ID_FIRST.match(body)
    if not first:
        return None
    try:
        value = _DECODER.raw_decode(body, first.end())[0]
    except ValueError:
        return None
    return value if isinstance(value, str) else None


def custom_id_of(body: str) -> str | None:
    """The top-level ``custom_id`` string of a JSON body, or None (no id, or not JSON).

    Fast path for the usual line that starts with it; else a full parse.
    """
    if _CUSTOM_ID_FIRST.match(body):
        return leading_custom_id(body)
    if '"custom_id"' not in body:
        return None
    try:
        parsed = json.loads(body)
    except (ValueError, RecursionError):
        return None  # the scheduler reports the line itself
    value = parsed.get("custom_id") if isinstance(parsed, dict) else None
    return value if isinstance(value, str) else None
