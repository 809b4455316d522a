"""Intake of embedding requests: route by task, tokenise every input as the embedding engine would,
and check it against the served model (vocabulary, context, ``dimensions``).

The body was validated already (``batchinfer.protocol.embed_bodies``); what needs the model is
checked here, so a bad line becomes an error row before it reaches a worker. Every problem is a
``RequestError`` naming the field and input index (``input[2]``), which the intake turns into the
line's error row.
"""

from __future__ import annotations

from typing import Any

from batchinfer.protocol.bodies import RequestSpec
from batchinfer.protocol.entries import EMBEDDINGS_URL, RequestError
from batchinfer.scheduler.lookups import ServedModel, checked_token_ids
from batchinfer.store.registry import ModelInfo
from batchinfer.workers.text.tokenizer import Tokenizer, truncate_text_ids


def check_task(spec: RequestSpec, model: str, info: ModelInfo) -> None:
    """An embeddings request goes to an embedding model only, a generation request to a generation
    model only (``model`` is the name the request asked for, an alias perhaps)."""
    if spec.task == "embed" and info.task != "embed":
        raise RequestError("invalid_request", f"model {model!r} is a generation model; {EMBEDDINGS_URL} "
                           "needs an embedding model", field="model")
    if spec.task != "embed" and info.task == "embed":
        asked = spec.url or ("chat messages" if spec.messages is not None else "a prompt")
        raise RequestError("invalid_request", f"model {model!r} is an embedding model; {asked} needs a "
                           f"generation model (send 'input' to {EMBEDDINGS_URL} for vectors)", field="model")


def embed_fields(spec: RequestSpec, served: ServedModel, max_prompt_tokens: int | None) -> dict[str, Any]:
    """The ``BatchRequest`` fields of an embedding request: ``task``, ``inputs`` (token ids per input,
    truncated as asked) and ``pooling_params`` (a dict)."""
    assert spec.inputs is not None and spec.pooling_params is not None  # an "embed" RequestSpec has both
    info, params = served.info, spec.pooling_params
    check_dimensions(params.dimensions, info)
    keep = params.truncate_prompt_tokens
    if keep is not None and keep > info.max_model_len:
        raise RequestError("invalid_request", f"truncate_prompt_tokens is {keep}, more than the model's "
                           f"context of {info.max_model_len} tokens", field="truncate_prompt_tokens")
    inputs = []
    given: list[str | list[int]] = list(spec.inputs)
    for i, item in enumerate(given):
        where = f"input[{i}]"
        tokenizer = served.tokenizer
        if isinstance(item, list):
            ids = checked_token_ids(item, tokenizer, where)
            ids = ids[-keep:] if keep is not None else ids
        else:
            ids = _encode(item, where, tokenizer)
            if keep is not None and len(ids) > keep:
                ids = truncate_text_ids(tokenizer, item, ids, keep)
        check_length(len(ids), where, info, max_prompt_tokens)
        inputs.append(ids)
    return {"task": "embed", "inputs": inputs, "pooling_params": params.to_dict()}


def check_dimensions(dimensions: int | None, info: ModelInfo) -> None:
    """``dimensions`` (Matryoshka truncation) only up to the model's width, and only on a model
    trained for it (the first N dimensions of another model's vector are not an embedding)."""
    if dimensions is None:
        return
    width = info.embedding_dim
    if width is not None and dimensions > width:
        raise RequestError("invalid_request", f"dimensions is {dimensions}, more than model "
                           f"{info.name!r}'s embedding width of {width}", field="dimensions")
    if not info.matryoshka:
        raise RequestError("invalid_request", f"model {info.name!r} does not support Matryoshka "
                           f"truncation (dimensions); omit dimensions to get its {width}-dimensional "
                           "vectors", field="dimensions")


def check_length(n: int, where: str, info: ModelInfo, max_prompt_tokens: int | None) -> None:
    """An input must fit the model's context, and one engine step (no chunked prefill for pooling)."""
    if max_prompt_tokens is not None and n > max_prompt_tokens:
        raise RequestError("prompt_too_long", f"{where} has {n} tokens, more than the limit of "
                           f"{max_prompt_tokens} (BATCHINFER_MAX_PROMPT_TOKENS)", field=where)
    if n > info.max_model_len:
        raise RequestError("prompt_too_long", f"{where} has {n} tokens, more than the model's context of "
                           f"{info.max_model_len} (give truncate_prompt_tokens to keep its last tokens)",
                           field=where)
    if n > info.max_num_batched_tokens:
        raise RequestError("prompt_too_long", f"{where} has {n} tokens, more than one step of the model's "
                           f"workers takes (max_num_batched_tokens {info.max_num_batched_tokens})",
                           field=where)


def _encode(text: str, where: str, tokenizer: Tokenizer) -> list[int]:
    try:
        ids = tokenizer.encode(text)  # with the post-processor's special tokens, as the engine's LLM.embed
    except (TypeError, ValueError) as e:  # the tokenizers library refuses some strings
        raise RequestError("invalid_request", f"{where} cannot be tokenised: {e}", field=where) from None
    if not ids:
        raise RequestError("invalid_request", f"{where} encodes to no tokens", field=where)
    return list(ids)
