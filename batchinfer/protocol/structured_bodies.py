"""The structured-output half of body validation (docs/protocol.md, "Structured outputs").

Every way users already ask for constrained output maps onto one
:class:`~batchinfer.workers.structured_params.StructuredOutputsParams`, which rides to the worker in
the request's ``SamplingParams.structured_outputs``:

- OpenAI ``response_format``: ``{"type": "text"}`` (no constraint), ``{"type": "json_object"}``,
  ``{"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}``
  (``strict: true`` closes every object schema without ``additionalProperties``; no ``schema``
  means any JSON object);
- vLLM ``structured_outputs``: ``{"json" | "regex" | "choice" | "grammar" | "json_object", ...}``;
- vLLM's older ``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar``, with
  ``guided_decoding_backend`` (accepted, the worker's flag decides; see :data:`GUIDED_BACKENDS`)
  and ``guided_whitespace_pattern`` (refused: whitespace is compact, or free with
  ``disable_any_whitespace: false``).

Only the body's shape is checked here; whether a schema or a regex compiles, and the size / depth
limits, are the scheduler's check with the model's tokenizer (``batchinfer.scheduler.structured_check``).
Every problem is a ``RequestError("invalid_request", ...)`` whose ``field`` is the exact path, e.g.
``response_format.json_schema.schema`` or ``guided_choice[2]``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from batchinfer.protocol.entries import STRUCTURED_FIELDS, STRUCTURED_OPTION_FIELDS, RequestError, short_repr
from batchinfer.workers.structured_params import StructuredOutputsParams

__all__ = ["GUIDED_BACKENDS", "pop_structured", "reject_for_embeddings"]

RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema")
JSON_SCHEMA_FIELDS = ("name", "schema", "strict", "description")
#: ``guided_decoding_backend`` names accepted (and ignored: each worker's --structured-outputs-backend
#: decides; "guidance" is vLLM's name for llguidance), and the vLLM ``name:option,...`` options.
GUIDED_BACKENDS = ("auto", "llguidance", "guidance", "xgrammar")
GUIDED_BACKEND_OPTIONS = ("disable-any-whitespace", "disable-additional-properties", "no-fallback")
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for json_schema.name
# vLLM StructuredOutputsParams fields that have no meaning here, and why.
_VLLM_REFUSED = {"whitespace_pattern": "a whitespace pattern is not supported: JSON output is compact by "
                                       "default; disable_any_whitespace: false allows any whitespace",
                 "structural_tag": "structural tags are not supported (use json, regex, choice or grammar)"}
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar"}
# A ValueError of StructuredOutputsParams starts with the field it is about: "json: ...",
# "choice[2] must be ...", "structured_outputs.x is not ...".
_LEAD = re.compile(r"^(structured_outputs(?:\.\w+)?|\w+)((?:\[\d+\])?)")


def _bad(message: str, field: str) -> RequestError:
    return RequestError("invalid_request", message, field=field)


def _constrains(name: str, value: Any) -> bool:
    """Whether body field ``name`` asks for a constraint (null and ``{"type": "text"}`` do not)."""
    if value is None:
        return False
    return not (name == "response_format" and isinstance(value, Mapping) and value.get("type") == "text"
                and len(value) == 1)


def pop_structured(body: dict[str, Any]) -> tuple[StructuredOutputsParams | None, str | None]:
    """Remove every structured-output field from ``body``; the constraint they ask for (or None) and
    the body path of its spec (what an error row about the spec names, e.g.
    ``response_format.json_schema.schema``). Two constraining fields at once are an error naming both."""
    given = {name: body.pop(name) for name in STRUCTURED_FIELDS if name in body}
    options = {name: body.pop(name) for name in STRUCTURED_OPTION_FIELDS if name in body}
    constraining = [name for name, value in given.items() if _constrains(name, value)]
    if len(constraining) > 1:
        first, second = constraining[:2]
        raise _bad(f"{first} and {second} both constrain the output: give one of them", second)
    extra = _options(options)
    params: StructuredOutputsParams | None = None
    where: str | None = None
    for name, value in given.items():
        if value is None:
            continue
        if name == "response_format":
            params, where = _response_format(value, extra)
        elif name == "structured_outputs":
            params, where = _vllm(value, extra)
        else:
            params, where = _guided(name, value, extra)
    return params, where


def reject_for_embeddings(body: Mapping[str, Any], endpoint: str) -> None:
    """An embeddings body names none of the structured-output fields (they shape generated text)."""
    for name in (*STRUCTURED_FIELDS, *STRUCTURED_OPTION_FIELDS):
        if name in body:
            raise _bad(f"{name} constrains generated text; {endpoint} generates none", name)


def _options(options: dict[str, Any]) -> dict[str, bool]:
    """``guided_decoding_backend`` / ``guided_whitespace_pattern`` as StructuredOutputsParams options."""
    pattern = options.get("guided_whitespace_pattern")
    if pattern is not None:
        raise _bad("guided_whitespace_pattern is not supported: JSON output is compact (no whitespace "
                   "between tokens) by default; structured_outputs.disable_any_whitespace: false allows "
                   "any whitespace", "guided_whitespace_pattern")
    backend = options.get("guided_decoding_backend")
    if backend is None:
        return {}
    if not isinstance(backend, str):
        raise _bad(f"guided_decoding_backend must be a string, got {short_repr(backend)}",
                   "guided_decoding_backend")
    name, _, opts = backend.partition(":")
    if name not in GUIDED_BACKENDS:
        raise _bad(f"guided_decoding_backend {name!r} is not available: the workers compile with "
                   f"llguidance or xgrammar (their --structured-outputs-backend); give one of "
                   f"{', '.join(GUIDED_BACKENDS)} or leave the field out", "guided_decoding_backend")
    out: dict[str, bool] = {}
    for opt in filter(None, (o.strip() for o in opts.split(","))):
        if opt not in GUIDED_BACKEND_OPTIONS:
            raise _bad(f"guided_decoding_backend option {opt!r} is not supported (options: "
                       f"{', '.join(GUIDED_BACKEND_OPTIONS)})", "guided_decoding_backend")
        if opt == "disable-additional-properties":
            out["disable_additional_properties"] = True
        elif opt == "disable-any-whitespace":
            out["disable_any_whitespace"] = True  # the default already; "no-fallback": we never fall back
    return out


def _response_format(value: Any, extra: dict[str, bool]) -> tuple[StructuredOutputsParams | None, str | None]:
    if not isinstance(value, Mapping):
        raise _bad(f"response_format must be an object {{\"type\": ...}}, got {short_repr(value)}",
                   "response_format")
    kind = value.get("type")
    if kind not in RESPONSE_FORMAT_TYPES:
        raise _bad(f"response_format.type must be one of {', '.join(RESPONSE_FORMAT_TYPES)}, got "
                   f"{short_repr(kind)}", "response_format.type")
    allowed = ("type", "json_schema") if kind == "json_schema" else ("type",)
    unknown = sorted(str(k) for k in value if k not in allowed)
    if unknown:
        raise _bad(f"response_format.{unknown[0]} is not a field of a {kind!r} response_format (it takes "
                   f"{', '.join(allowed)})", f"response_format.{unknown[0]}")
    if kind == "text":
        return None, None
    if kind == "json_object":
        return _params({"json_object": True, **extra}, {}, "response_format"), "response_format"
    spec = value.get("json_schema")
    where = "response_format.json_schema"
    if not isinstance(spec, Mapping):
        raise _bad(f"{where} must be an object {{\"name\", \"schema\", \"strict\", \"description\"}}, got "
                   f"{short_repr(spec)}", where)
    unknown = sorted(str(k) for k in spec if k not in JSON_SCHEMA_FIELDS)
    if unknown:
        raise _bad(f"{where}.{unknown[0]} is not a json_schema field (it takes "
                   f"{', '.join(JSON_SCHEMA_FIELDS)})", f"{where}.{unknown[0]}")
    name = spec.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        what = ("is missing" if name is None
                else f"must be 1 to 64 letters, digits, '_' or '-', got {short_repr(name)}")
        raise _bad(f"{where}.name {what} (OpenAI requires a name)", f"{where}.name")
    description = spec.get("description")
    if description is not None and not isinstance(description, str):
        raise _bad(f"{where}.description must be a string, "
                   f"got {short_repr(description)}", f"{where}.description")
    strict = spec.get("strict")
    if strict not in (None, True, False):
        raise _bad(f"{where}.strict must be a boolean, got {short_repr(strict)}", f"{where}.strict")
    schema = spec.get("schema")
    if schema is None:  # OpenAI: the schema is optional; without one, any JSON object
        return _params({"json_object": True, **extra}, {}, where), where
    if strict:
        extra = {**extra, "disable_additional_properties": True}
    path = f"{where}.schema"
    return _params({"json": schema, **extra}, {"json": path}, path), path


def _vllm(value: Any, extra: dict[str, bool]) -> tuple[StructuredOutputsParams, str]:
    if not isinstance(value, Mapping):
        raise _bad(f"structured_outputs must be an object, got {short_repr(value)}", "structured_outputs")
    given = dict(value)
    for name, why in _VLLM_REFUSED.items():
        if given.get(name) is not None:
            raise _bad(f"structured_outputs.{name}: {why}", f"structured_outputs.{name}")
        given.pop(name, None)
    fallback = given.pop("disable_fallback", None)  # vLLM's; there is no fallback backend to disable
    if fallback not in (None, True, False):
        raise _bad(f"structured_outputs.disable_fallback must be a boolean, got {short_repr(fallback)}",
                   "structured_outputs.disable_fallback")
    names = {k: f"structured_outputs.{k}" for k in StructuredOutputsParams.FIELDS}
    params = _params({**extra, **given}, names, "structured_outputs")
    return params, f"structured_outputs.{params.kind}"


def _guided(name: str, value: Any, extra: dict[str, bool]) -> tuple[StructuredOutputsParams, str]:
    kind = _GUIDED[name]
    if kind == "choice" and not isinstance(value, list):
        raise _bad(f"{name} must be a non-empty list of strings, got {short_repr(value)}", name)
    return _params({kind: value, **extra}, {kind: name}, name), name


def _params(given: dict[str, Any], names: dict[str, str], where: str) -> StructuredOutputsParams:
    """``StructuredOutputsParams.from_dict(given)``; its error renamed to the body's path (``names``:
    params field -> body path; ``where``: the path of an error about the whole spec)."""
    if given.get("json") is False:  # the schema `false`: StructuredOutputsParams would read it as unset
        path = names.get("json", where)
        raise _bad(f"{path}: the schema false matches no value", path)
    try:
        return StructuredOutputsParams.from_dict(given)
    except (ValueError, TypeError) as e:
        message = str(e)
        m = _LEAD.match(message)
        lead, index = (m.group(1), m.group(2)) if m else ("", "")
        if lead in names:
            path = names[lead] + index
            message = path + message[len(lead) + len(index):]
        elif lead.startswith("structured_outputs."):  # an unknown key of structured_outputs
            path = lead
        else:
            path = where
            if not message.startswith(where):
                message = f"{where}: {message.removeprefix('structured_outputs: ')}"
        raise _bad(message, path) from None

