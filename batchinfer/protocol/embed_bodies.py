"""The embedding half of body validation (docs/protocol.md, "Embeddings"): ``input`` and the pooling
fields of a ``/v1/embeddings`` line or a plain body with ``input``.

Called by :mod:`batchinfer.protocol.bodies`, which checks the fields every body shares (custom_id,
model, priority, metadata). Only what the body alone decides is checked here; what depends on the
model (token counts, vocabulary, ``dimensions`` against the model's width) is the scheduler's intake
(``batchinfer.scheduler.embed_intake``). Every problem is a ``RequestError`` naming the field and
index, e.g. ``input[3]``.
"""

from __future__ import annotations

from typing import Any

from batchinfer.protocol.entries import (
    EMBED_FIELDS,
    MAX_EMBED_INPUTS,
    REQUEST_FIELDS,
    RequestError,
    short_repr,
)
from batchinfer.workers.pooling_params import PoolingParams
from batchinfer.workers.sampling_params import SamplingParams

#: The inputs of one request: texts, or token-id lists; one vector each.
EmbedInputs = list[str] | list[list[int]]

_GENERATION_INPUTS = ("prompt", "prompt_token_ids", "messages")
# OpenAI generation names that are sampling parameters too (mapped onto ours for completions).
_OPENAI_SAMPLING = ("max_completion_tokens", "top_logprobs", "echo", "suffix", "best_of", "stream")


def check_embed_fields(body: dict[str, Any], endpoint: str) -> None:
    """Reject what an embeddings body must not hold: generation inputs beside ``input``, sampling
    parameters (by name: they would be silently meaningless), and unknown fields."""
    for name in _GENERATION_INPUTS:
        if name in body:
            raise RequestError("invalid_request", f"give either input (an embeddings request) or {name} "
                               f"(generation), not both", field=name)
    sampling = sorted(k for k in body if k in SamplingParams.FIELDS or k in _OPENAI_SAMPLING)
    if sampling:
        raise RequestError("invalid_request", f"{sampling[0]} is a sampling parameter; {endpoint} takes "
                           f"none (it takes {', '.join(EMBED_FIELDS)})", field=sampling[0])
    unknown = sorted(k for k in body if k not in REQUEST_FIELDS and k not in EMBED_FIELDS)
    if unknown:
        raise RequestError("invalid_request", f"unknown field(s) for {endpoint}: {', '.join(unknown)}",
                           field=unknown[0])


def parse_inputs(value: Any) -> EmbedInputs:
    """``input`` as OpenAI takes it: a string, a list of strings, a list of token ids (one input)
    or a list of token-id lists; one vector per element (a token-id list is one element)."""
    if isinstance(value, str):
        if not value:
            raise RequestError("invalid_request", "input must not be an empty string", field="input")
        return [value]
    if not isinstance(value, list):
        raise RequestError("invalid_request", f"input must be a string, a list of strings, a list of token "
                           f"ids or a list of token-id lists, got {short_repr(value)}", field="input")
    if not value:
        raise RequestError("invalid_request", "input must not be an empty list", field="input")
    first = value[0]
    kind: type
    if _is_int(first):
        return [_token_ids(value, "input")]  # one input given as token ids
    if isinstance(first, str):
        kind, what = str, "a string"
    elif isinstance(first, list):
        kind, what = list, "a list of token ids"
    else:
        raise RequestError("invalid_request", f"input[0] must be a string, a token id or a list of token "
                           f"ids, got {short_repr(first)}", field="input[0]")
    if len(value) > MAX_EMBED_INPUTS:
        raise RequestError("invalid_request", f"input has {len(value)} elements, more than the limit of "
                           f"{MAX_EMBED_INPUTS} per request (split it over several lines)", field="input")
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, kind) or _is_int(item):
            mixed = " (input mixes kinds: every element must be of input[0]'s kind)" \
                if isinstance(item, (str, list)) or _is_int(item) else ""
            raise RequestError("invalid_request", f"{where} must be {what}, got {short_repr(item)}{mixed}",
                               field=where)
        if kind is str and not item:
            raise RequestError("invalid_request", f"{where} must not be an empty string", field=where)
    if kind is list:
        return [_token_ids(item, f"input[{i}]") for i, item in enumerate(value)]
    return list(value)


def parse_pooling(body: dict[str, Any]) -> PoolingParams:
    """The body's pooling fields as ``PoolingParams`` (its messages start with the field's name)."""
    given = {k: body[k] for k in PoolingParams.FIELDS if body.get(k) is not None}
    try:
        return PoolingParams(**given)
    except (TypeError, ValueError) as e:
        first = str(e).split(" ", 1)[0]
        raise RequestError("invalid_request", str(e), field=first if first in given else None) from None


def _token_ids(value: list[Any], where: str) -> list[int]:
    if not value:
        raise RequestError("invalid_request", f"{where} must be a non-empty list of token ids", field=where)
    for j, t in enumerate(value):
        if not _is_int(t) or t < 0 or t >= 2**31:
            raise RequestError("invalid_request", f"{where}[{j}] must be a token id (integer >= 0), got "
                               f"{short_repr(t)}", field=f"{where}[{j}]")
    return list(value)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)

