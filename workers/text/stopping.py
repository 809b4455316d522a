"""When a completion stops, and with which text: one pure function the engine calls per token.

What ends a completion, checked in this order after each sampled token (vLLM v1's rules):

- ``"stop"``, stop_reason ``None``: an EOS token (generation_config's ``eos_token_id``), unless
  ``ignore_eos``;
- ``"stop"``, stop_reason = the token id: one of ``stop_token_ids``;
- ``"stop"``, stop_reason = the string: a stop string completed by this token's text;
- ``"length"``: ``max_tokens`` tokens generated, or the engine's ``max_len_reached``
  (the sequence filled ``max_model_len``).

The three kinds of ``"stop"`` apply only once the completion has more than ``min_tokens``
tokens (the sampler already masks EOS and stop ids before that). A stop wins over ``"length"``
on the same token.

Tokens and text, as vLLM returns them: the EOS or stop token id stays the last of the
completion's ``token_ids``, but its text is left out (kept with ``include_stop_str_in_output``);
a stop string is cut from the text together with anything after it (kept, up to its end, with
``include_stop_str_in_output``), while the tokens that spelled it stay in ``token_ids``.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import NamedTuple

from batchinfer.workers.sampling_params import SamplingParams
from batchinfer.workers.text.detokenizer import IncrementalDetokenizer, find_stop_string


class StopResult(NamedTuple):
    finish_reason: str  # "stop" | "length"
    stop_reason: str | int | None  # the stop string or stop token id; None for EOS and length
    text: str  # the completion's final text


def is_stop_token(num_output_tokens: int, new_token_id: int, params: SamplingParams,
                  eos_token_ids: Collection[int]) -> bool:
    """Whether ``new_token_id``, the completion's ``num_output_tokens``-th token, ends it as an EOS
    or stop token: then :func:`check_stop` does not append its text the ordinary way, so a caller
    that appends texts in bulk (``detokenizer.append_tokens``) must leave this one out."""
    if num_output_tokens <= params.min_tokens:
        return False
    # `or ()` only narrows the type: __post_init__ has made stop_token_ids a list
    return ((not params.ignore_eos and new_token_id in eos_token_ids)
            or new_token_id in (params.stop_token_ids or ()))


def check_stop(
    output_token_ids: Sequence[int],
    new_token_id: int,
    params: SamplingParams,
    eos_token_ids: Collection[int],
    detok: IncrementalDetokenizer | None,
    max_len_reached: bool = False,
    new_text: str | None = None,
) -> StopResult | None:
    """Account for ``new_token_id`` and say whether its completion is finished.

    ``output_token_ids`` are the completion's tokens *including* ``new_token_id`` as the last one
    (the engine appends first, then checks). The token's text goes into ``detok`` (``None``:
    the request is not detokenised, so stop strings cannot apply), unless the caller already put
    it there: then ``new_text`` is what ``detok.append`` returned (never for a stop token, see
    :func:`is_stop_token`). Returns ``None`` while the completion goes on (its text so far is
    ``detok.text``).
    """
    if not output_token_ids or output_token_ids[-1] != new_token_id:
        raise ValueError("output_token_ids must end with new_token_id (append the token, then check)")
    may_stop = len(output_token_ids) > params.min_tokens
    if new_text is not None and (
            detok is None or is_stop_token(len(output_token_ids), new_token_id, params, eos_token_ids)):
        raise ValueError("new_text: given for a stop token or a completion without a detokenizer")

    if may_stop and not params.ignore_eos and new_token_id in eos_token_ids:
        return StopResult("stop", None, _final_text(detok, new_token_id, params))
    # `or ()` only narrows the type: __post_init__ has made stop_token_ids a list
    if may_stop and new_token_id in (params.stop_token_ids or ()):
        return StopResult("stop", new_token_id, _final_text(detok, new_token_id, params))

    if detok is not None:
        if new_text is None:
            new_text = detok.append(new_token_id)
        if may_stop and params.stop and new_text:
            include = params.include_stop_str_in_output
            found = find_stop_string(detok.text, len(new_text), params.stop, include)
            if found is not None:
                detok.truncate(found[1])
                return StopResult("stop", found[0], detok.text)

    if max_len_reached or (params.max_tokens is not None and len(output_token_ids) >= params.max_tokens):
        if detok is None:
            return StopResult("length", None, "")
        detok.flush()
        return StopResult("length", None, detok.text)
    return None


def _final_text(detok: IncrementalDetokenizer | None, stop_token_id: int, params: SamplingParams) -> str:
    """Text of a completion ended by a stop token: the token's own text only when asked for."""
    if detok is None:
        return ""
    if params.include_stop_str_in_output:
        detok.append(stop_token_id)
    detok.flush()
    return detok.text
