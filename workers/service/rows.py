"""The result row of a request the engine finished: an engine output, turned into the wire format.

The wire format (``batchinfer.protocol.rows``) knows nothing of the engine's output types; this
module, on the worker service's side, is where the two meet.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from batchinfer.protocol.rows import BatchRequest, ResultRow, encode_vector, now_ms
from batchinfer.workers.engine.outputs import Logprob, PooledRequestOutput, RequestOutput, SampleLogprobs
from batchinfer.workers.tools import ToolSpec, extract_tool_calls, finish_reason_with_tools


def _token_fields(token_id: int, lp: Logprob) -> dict[str, Any]:
    token, raw = lp.decoded_token, lp.token_bytes
    if raw is None and token is not None:
        raw = token.encode("utf-8")
    return {"token_id": token_id, "token": token, "bytes": None if raw is None else list(raw),
            "logprob": lp.logprob}


def logprob_entry(token_id: int, step: SampleLogprobs, top_k: int | None = None) -> dict[str, Any]:
    """A row's logprobs of one generated token (docs/protocol.md "Result row"):
    ``{token_id, token, bytes, logprob, top_logprobs: [{token_id, token, bytes, logprob}]}``.

    ``top_logprobs`` are the ``top_k`` most likely tokens (the request's ``logprobs``), best first:
    the engine's entries of rank 1..k, which hold the sampled token only when it is one of them.
    """
    k = len(step) if top_k is None else top_k
    top = sorted((item for item in step.items() if item[1].rank is not None and item[1].rank <= k),
                 key=lambda item: item[1].rank or 0)
    entry = _token_fields(token_id, step[token_id])
    entry["top_logprobs"] = [_token_fields(t, lp) for t, lp in top]
    return entry


def with_tool_calls(request: BatchRequest, outs: list[dict[str, Any]], parser: str | None) -> None:
    """Each output's text split into its content and its tool calls (``request.tools``): ``text``
    becomes the content ("" when the completion was only calls), ``tool_calls`` the calls, and
    ``finish_reason`` "tool_calls" when calls were made. Call ids are derived from the request id
    and the completion's index, so that a retried request names its calls the same.

    Raises :class:`~batchinfer.workers.tools.ToolParserMissing` for ``tool_choice: "auto"`` when
    no ``parser`` is known (the worker's ``--tool-call-parser``, or its chat template's)."""
    if request.tools is None:
        return
    spec = ToolSpec.from_dict(request.tools)
    for out in outs:
        seed = f"{request.request_id}:{out['index']}"
        found = extract_tool_calls(out["text"], spec, parser, call_id_seed=seed)
        out["text"] = found.content or ""
        out["tool_calls"] = found.tool_calls
        out["finish_reason"] = finish_reason_with_tools(out["finish_reason"], found.tool_calls)


def generation_row(request: BatchRequest, output: RequestOutput, *, worker: str | None = None,
                   started_at: int | None = None, finished_at: int | None = None,
                   status: str = "completed", tool_parser: str | None = None) -> ResultRow:
    """The row of a request the engine finished (``status="cancelled"`` for an aborted one).

    A request with tools has its outputs' tool calls extracted (:func:`with_tool_calls`, with
    ``tool_parser`` for ``auto``); ``ToolParserMissing`` when ``auto`` has no parser."""
    top_k = request.sampling_params.get("logprobs")
    outs: list[dict[str, Any]] = [
        {"index": o.index, "text": o.text, "token_ids": list(o.token_ids),
         "finish_reason": o.finish_reason, "stop_reason": o.stop_reason,
         "logprobs": None if o.logprobs is None else [
             logprob_entry(t, step, top_k) for t, step in zip(o.token_ids, o.logprobs, strict=False)],
         "cumulative_logprob": o.cumulative_logprob,
         "structured": o.structured, "structured_complete": o.structured_complete, "tool_calls": None}
        for o in output.outputs
    ]
    with_tool_calls(request, outs, tool_parser)
    first: dict[str, Any] = outs[0] if outs else {"text": None, "token_ids": None, "finish_reason": None,
                                                  "structured": None, "structured_complete": None,
                                                  "tool_calls": None}
    return ResultRow(
        job_id=request.job_id, request_id=request.request_id, status=status, idx=request.idx,
        custom_id=request.custom_id, model=request.model, finish_reason=first["finish_reason"],
        output_text=first["text"], output_token_ids=first["token_ids"], outputs=outs,
        structured=first["structured"], structured_complete=first["structured_complete"],
        prompt_tokens=len(output.prompt_token_ids),
        completion_tokens=sum(len(o["token_ids"]) for o in outs),
        cached_tokens=output.num_cached_tokens,
        accepted_prediction_tokens=_total(o.accepted_prediction_tokens for o in output.outputs),
        rejected_prediction_tokens=_total(o.rejected_prediction_tokens for o in output.outputs),
        line=request.line, created_at=request.created_at,
        started_at=started_at, finished_at=finished_at if finished_at is not None else now_ms(),
        worker=worker, sampling_params=request.sampling_params, metadata=dict(request.metadata),
        url=request.url, tool_calls=first["tool_calls"],
    )


def _total(counts: Iterable[int | None]) -> int | None:
    """The completions' counts summed; None when none has one (the request gave no prediction)."""
    known = [c for c in counts if c is not None]
    return sum(known) if known else None


def embedding_row(request: BatchRequest, output: PooledRequestOutput, *, worker: str | None = None,
                  started_at: int | None = None, finished_at: int | None = None) -> ResultRow:
    """The row of an embedding request the engine finished: one vector per input, in order."""
    data = output.data  # [num_inputs, dim] float32 on the CPU
    vectors = data.numpy() if hasattr(data, "numpy") else data
    return ResultRow(
        job_id=request.job_id, request_id=request.request_id, status="completed", idx=request.idx,
        custom_id=request.custom_id, model=request.model, output_text=None,
        embeddings=[encode_vector(v) for v in vectors], prompt_tokens=output.num_prompt_tokens,
        completion_tokens=0, line=request.line, created_at=request.created_at,
        started_at=started_at, finished_at=finished_at if finished_at is not None else now_ms(),
        worker=worker, pooling_params=request.pooling_params, metadata=dict(request.metadata),
        url=request.url,
    )
