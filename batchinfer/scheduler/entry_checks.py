"""A request entry's checks, which the intake's ``Admission.admit`` applies in this order, and
what an entry comes to: staged, rejected (its row), held, dropped as a duplicate, or refused.

An entry that is not one is still answered in its job when it names one (:func:`malformed`).
The body's size (:func:`check_size`). Against its job: that it can be counted in it
(:func:`refusal`: the job exists, the idx is in range and not taken already), that the job has not
ended (:func:`ended_row`), the model it runs on (:func:`run_model`: the job's wins over the line's)
and how long it waits for a model no worker serves yet (:func:`hold_deadline`; an adapter of a
served model is refused at once, :func:`unknown_adapter`). Against its model, for a generation
request: its tokens (:func:`prompt_tokens`; ``messages`` with their tools through the chat
template, :func:`render_chat`) and their length (:func:`check_length`), and the sampling
parameters' token ids (:func:`check_sampling_token_ids`).

A check that fails raises the :class:`RequestError` of the entry's row, or returns the row itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypedDict, cast

from batchinfer.keys import Keys
from batchinfer.protocol.bodies import RequestSpec, leading_custom_id
from batchinfer.protocol.entries import IntakeEntry, RequestError, valid_job_id
from batchinfer.protocol.rows import BatchRequest, ResultRow, request_id_for
from batchinfer.scheduler.lookups import JobCache, JobView, ModelCache, checked_token_ids
from batchinfer.workers.text.tokenizer import PromptTooLong, Tokenizer
from batchinfer.workers.tools import ToolSpec, template_messages

DEFAULT_WINDOW_S = 24 * 3600  # how long a job without expires_at waits for an unknown model


@dataclass
class Stage:
    """A valid request: staged for ``model`` (its canonical name) at ``priority``."""

    model: str
    priority: int
    request: BatchRequest
    overridden: str | None = None  # the line's own model, when the job's won over it


@dataclass
class Reject:
    """A request answered at once with ``row`` (an error, or its job's ``cancelled`` / ``expired``)."""

    row: ResultRow
    reply_to: str | None
    overridden: str | None = None


@dataclass
class Hold:
    """A request for a model no worker serves yet: kept in the holding area until then."""

    until: int  # ms: when the request gives up waiting for its model
    row: ResultRow  # its unknown_model row, for then (or for a full holding area)
    reply_to: str | None
    model: str = ""  # the model it waits for (counted in {p}:held_models)
    overridden: str | None = None


class Duplicate:
    """An entry whose client_request_id was already accepted for another request: dropped, and its
    ``reply_to`` owed that request's row (``Redelivery``)."""


@dataclass
class Refuse:
    """An entry that cannot be counted in its job: answered as a direct request (``row`` has no job),
    with ``job_error`` for the job's record when the job exists."""

    row: ResultRow
    reply_to: str | None
    job_id: str | None = None
    job_error: str | None = None


Outcome = Stage | Reject | Hold | Duplicate | Refuse


class _RowIds(TypedDict):
    """What every error row of an entry names (keyword arguments of ``ResultRow.error``)."""

    job_id: str | None
    idx: int | None
    request_id: str
    line: int | None
    created_at: int


class RowBase(_RowIds, total=False):
    """Plus what is known once the job and the body have been read."""

    model: str
    custom_id: str | None
    metadata: dict[str, str]
    url: str | None


def entry_ms(entry_id: str) -> int:
    """The ms timestamp of a stream entry id (when the entry was added)."""
    return int(entry_id.split("-", 1)[0])


def error_row(e: RequestError, base: RowBase) -> ResultRow:
    """The row of an entry that failed a check (``base``: its ids, and what is known of it)."""
    message = f"{e.field}: {e.message}" if e.field and e.field not in e.message else e.message
    row = base.copy()
    row["line"] = e.line or base["line"]
    row["custom_id"] = base.get("custom_id") or e.context.get("custom_id")
    return ResultRow.error(e.code, message, **row)


def check_entry(entry: IntakeEntry, keys: Keys, max_requests: int) -> None:
    """The routing fields a producer sent, against this deployment: ``reply_to`` inside the reply
    namespace (a row, and its stream's expiry, never reach another key) and ``idx`` below the job's
    request limit (admissions are a bitmap: a far idx would cost Redis memory for nothing).
    Raises the entry's ``protocol_error`` (its context routes the row to the job)."""
    context: dict[str, Any] = {"job": entry.job_id, "idx": entry.idx, "line": entry.line}
    if entry.reply_to is not None and (why := wrong_reply(keys, entry.reply_to, entry.job_id)):
        raise RequestError("protocol_error", why, field="reply_to", line=entry.line, context=context)
    context["reply_to"] = entry.reply_to
    if entry.job_id is not None and (why := wrong_partition(keys, entry.job_id)):
        raise RequestError("protocol_error", f"{why}; this entry was not run", field="job", line=entry.line,
                           context=context)
    if entry.idx is not None and entry.idx >= max_requests:
        context["idx"] = None  # not counted in the job: the row is a direct one
        raise RequestError("protocol_error", f"idx {entry.idx} is out of range: a job holds at most "
                           f"{max_requests} requests (idx 0..{max_requests - 1}, "
                           "BATCHINFER_MAX_REQUESTS_PER_JOB); this entry was not run", field="idx",
                           line=entry.line, context=context)


def wrong_partition(keys: Keys, job_id: str) -> str | None:
    """Why an entry of ``job_id`` read from ``keys``' partition is not its job's (None: it is): a
    producer that routes by another ``BATCHINFER_PARTITIONS`` than the deployment's."""
    home = keys.job_partition(job_id)
    if home == keys.partition:
        return None
    return (f"job {job_id!r} lives in partition {home} of {keys.partitions}: its entries go to "
            f"{keys.part(home).requests}, not {keys.requests} (every producer must use the deployment's "
            "BATCHINFER_PARTITIONS; docs/protocol.md, Partitions)")


def wrong_reply(keys: Keys, reply_to: str, job_id: str | None) -> str | None:
    """Why ``reply_to`` may not get the rows of an entry of ``job_id`` (None: it may). It must be a
    key of the reply namespace (a row, and its stream's expiry, never reach another key), and of the
    partition where the row is published (its job's; direct requests': 0), so that the publication
    touches one Redis Cluster slot (docs/protocol.md)."""
    home = keys.job_partition(job_id)
    where = keys.reply_partition(reply_to)
    if where == home:
        return None
    if where is None:
        return (f"reply_to {reply_to!r} is not a reply stream: it must be a key under "
                f"{keys.part(home).reply('')!r} (docs/protocol.md)")
    whose = f"job {job_id!r}" if job_id else "a direct request"
    return (f"reply_to {reply_to!r} is in partition {where}, but the rows of {whose} are published in "
            f"partition {home}: name a key under {keys.part(home).reply('')!r} "
            "(docs/protocol.md, Partitions)")


def reply_stream(keys: Keys, reply_to: object, home: int | None = None) -> str | None:
    """``reply_to`` when it names a key of the reply namespace (of partition ``home`` when given:
    where the row is published), else None: no row (nor the expiry a row sets) is ever written to a
    key a producer named outside it."""
    if not isinstance(reply_to, str):
        return None
    where = keys.reply_partition(reply_to)
    return reply_to if where is not None and (home is None or where == home) else None


def routable(e: RequestError, keys: Keys, max_requests: int) -> RequestError:
    """``e`` with only the parts of its context a row may be routed by: a ``reply_to`` in the reply
    namespace, an ``idx`` below the job's request limit (the row is counted in the job: its bit is
    set)."""
    job = e.context.get("job")
    e.context["reply_to"] = reply_stream(keys, e.context.get("reply_to"),
                                         keys.job_partition(job if isinstance(job, str) else None))
    idx = e.context.get("idx")
    if not isinstance(idx, int) or not 0 <= idx < max_requests:
        e.context["idx"] = None
    return e


def check_sequences(spec: RequestSpec, max_n: int) -> None:
    """``n`` within the deployment's bound: one request's sequences hold a worker as ``n`` requests do."""
    n = spec.sampling_params.n
    if n > max_n:
        raise RequestError("invalid_request", f"n must be <= {max_n} (BATCHINFER_MAX_N), got {n}", field="n")


def check_sampling_token_ids(spec: RequestSpec, tokenizer: Tokenizer) -> None:
    """``logit_bias`` keys and ``allowed_token_ids`` within the model's vocabulary, as the prompt's
    ids are (the worker's engine refuses them too, but only after dispatch)."""
    params = spec.sampling_params
    vocab = tokenizer.vocab_size
    for token in params.logit_bias or {}:
        if token >= vocab:
            raise RequestError("invalid_request", f"token id {token} is outside the model's vocabulary of "
                               f"{vocab} tokens", field=f"logit_bias[{token}]")
    checked_token_ids(params.allowed_token_ids or [], tokenizer, "allowed_token_ids")


def check_size(body: str, limit: int) -> None:
    """Producers other than the submitter may XADD any size: the line limit holds for them too."""
    # len() counts characters; only text that might be over the limit is encoded to count bytes
    if len(body) > limit or (4 * len(body) > limit and len(body.encode("utf-8", "replace")) > limit):
        custom_id = leading_custom_id(body)  # cheap: the rest of the body is never parsed
        raise RequestError("line_too_long", f"body is {len(body.encode('utf-8', 'replace'))} bytes, more "
                           f"than the limit of {limit} bytes (BATCHINFER_MAX_LINE_BYTES)", field="body",
                           context={"custom_id": custom_id} if custom_id else None)


def refusal(entry_id: str, view: JobView, idx: int | None, reply_to: str | None,
            taken: set[tuple[str, int]] | frozenset[tuple[str, int]], line: int | None = None,
            custom_id: str | None = None) -> Refuse | None:
    """Why an entry for job ``view`` cannot be counted in it, as a :class:`Refuse`; None if it can."""
    job = view.job_id
    if not view.exists:
        why = (f"job {job!r} does not exist: open it first with an 'op open' entry "
               f"(docs/protocol.md, Jobs); this entry (idx {idx}) was not run")
    elif idx is None:
        return None
    elif view.total is not None and idx >= view.total:
        why = (f"idx {idx} is out of range: job {job!r} was closed with total {view.total} "
               f"(idx 0..{view.total - 1}); this entry was not run")
    elif (job, idx) in taken:
        why = (f"idx {idx} of job {job!r} was already taken in (by an earlier entry, or filled when "
               "the job was closed without it); this entry was not run")
    else:
        return None
    row = ResultRow.error("protocol_error", why, job_id=None, request_id=entry_id, line=line,
                          custom_id=custom_id, created_at=entry_ms(entry_id))
    return Refuse(row, reply_to, job, why if view.exists else None)


def malformed(entry_id: str, e: RequestError, jobs: JobCache,
              taken: set[tuple[str, int]] | frozenset[tuple[str, int]] = frozenset()) -> Reject | Refuse:
    """An entry that is not a valid intake entry: its row goes to its job if one can be read (and
    the entry could be counted in it)."""
    ctx = e.context
    job, idx = ctx.get("job"), ctx.get("idx")
    routable = isinstance(job, str) and valid_job_id(job) and isinstance(idx, int) and idx >= 0
    if routable and isinstance(job, str):
        refused = refusal(entry_id, jobs.get(job), idx, ctx.get("reply_to"), taken, ctx.get("line"))
        if refused is not None:
            refused.row.error_message = f"{refused.row.error_message} (and the entry is malformed: {e})"
            return refused
    base: RowBase = {"job_id": job if routable else None, "idx": idx if routable else None,
                     "request_id": request_id_for(job, idx) if routable else entry_id,
                     "line": ctx.get("line"), "created_at": entry_ms(entry_id)}
    return Reject(error_row(e, base), ctx.get("reply_to"))


def ended_row(view: JobView | None, **row: Any) -> ResultRow | None:
    """The ``cancelled`` / ``expired`` row (fields ``row``) of a request whose job ended before it ran;
    None while the job runs (or for a direct request)."""
    ended = view.ended_as() if view else None
    if not ended:
        return None
    return ResultRow.error(ended, f"the job was {ended} before this request ran", status=ended, **row)


def run_model(models: ModelCache, line_model: str | None, view: JobView | None,
              first_read: bool) -> tuple[str | None, str | None]:
    """The model a request runs on, and the line's own model when the job's won over it.

    The job's model wins (an OpenAI batch file names a hosted model in every line), except over a
    line naming an adapter of it (``run --lora``). An overridden line is counted once, when first
    taken in (``first_read``), not again when a held one is re-read.
    """
    job_model = view.model if view else None
    if job_model and line_model and adapter_of(models, line_model, job_model):
        job_model = None  # a line naming an adapter of the job's model keeps it
    overridden = (line_model if job_model and line_model and line_model != job_model and first_read
                  else None)
    return job_model or line_model, overridden


def adapter_of(models: ModelCache, line_model: str, job_model: str) -> bool:
    """Whether ``line_model`` names an adapter of ``job_model`` (served: ``NAME``, ``BASE:NAME``,
    ``ALIAS:NAME``; or not served but ``<job model>:NAME``, which then gets its unknown-adapter row
    instead of silently running on the base)."""
    if line_model == job_model:
        return False
    job = models.get(job_model)
    if job is None or job.info.adapter is not None:
        return False
    line = models.get(line_model)
    if line is not None:
        return line.info.base_model == job.info.name
    head = line_model.rpartition(":")[0]
    return head in (job_model, job.info.name)


def unknown_line_model(models: ModelCache, line_model: str | None, view: JobView | None) -> str | None:
    """The ``unknown_model`` message of a line naming a model its job's model does not answer to,
    when adapters are served for the job's model; else None (the job's model answers the line).

    With adapters a line's model picks one, so a name that is neither the job's model, an alias
    of it nor one of its served adapters (a typo of an adapter, say) is not answered by the base;
    without adapters, the job's model answers every line (hosted names in OpenAI files).
    ``<job model>:NAME`` not served is left to :func:`unknown_adapter`.
    """
    job_model = view.model if view else None
    if not job_model or not line_model or line_model == job_model:
        return None
    job = models.get(job_model)
    if job is None or job.info.adapter is not None or adapter_of(models, line_model, job_model):
        return None
    line = models.get(line_model)
    if line is not None and line.info.name == job.info.name:  # an alias of the job's model
        return None
    names = models.adapters(job.info.name)
    if not names:
        return None
    return (f"model {line_model!r} is not served for the job's model {job_model!r}: neither it, an alias "
            f"of it nor one of its adapters; served adapters: {', '.join(names)}")


def unknown_adapter(models: ModelCache, model: str) -> str | None:
    """The ``unknown_model`` message of ``model`` = ``X:Y`` (not served itself) when X names a served
    model, so Y asks for an adapter of it that is not served; None for any other unknown name.

    Only the last ``:`` splits (model names may hold one, e.g. ``llama3:8b``, and adapter names
    hold none); the full name was tried first by the caller."""
    head, sep, adapter = model.rpartition(":")
    if not sep or not head or not adapter:
        return None
    served = models.get(head)
    if served is None or served.info.adapter is not None:
        return None
    base = served.info.name
    names = models.registry.adapters_of(base)
    return (f"model {model!r}: adapter {adapter!r} is not served for model {base!r}; "
            f"served adapters: {', '.join(names) if names else 'none'}")


def hold_deadline(view: JobView | None, now: int, hold_seconds: float | None, direct_hold_s: float) -> int:
    """When a request for an unserved model gives up: a direct one after ``hold_seconds`` (the entry's)
    or ``direct_hold_s``; a job's at the end of its window, or after ``hold_seconds`` if sooner."""
    if view is None:
        return now + int((direct_hold_s if hold_seconds is None else hold_seconds) * 1000)
    window_end = view.expires_at or now + DEFAULT_WINDOW_S * 1000
    return window_end if hold_seconds is None else min(window_end, now + int(hold_seconds * 1000))


def prompt_limit(max_model_len: int, max_prompt_tokens: int | None) -> int:
    """The most prompt tokens a request for this model may have (:func:`check_length`'s bounds)."""
    limit = max_model_len - 1
    return limit if max_prompt_tokens is None else min(limit, max_prompt_tokens)


def prompt_tokens(spec: RequestSpec, tokenizer: Tokenizer, limit: int | None = None) -> list[int]:
    """A generation request's prompt as token ids: given ones checked against the vocabulary,
    ``messages`` through the chat template, a ``prompt`` encoded.

    With ``limit``, a text that certainly has more tokens is refused (``prompt_too_long``) before it
    is tokenised whole (``Tokenizer.encode_within``): a 10 MB prompt costs a length check, not
    half a minute of the scheduler's only thread."""
    if spec.prompt_token_ids is not None:
        return checked_token_ids(spec.prompt_token_ids, tokenizer, "prompt_token_ids")
    text: str
    field = "messages" if spec.messages is not None else "prompt"
    if spec.messages is not None:
        text = render_chat(spec, tokenizer)
    else:
        assert spec.prompt is not None  # a RequestSpec holds exactly one of the three
        text = spec.prompt
    try:
        # the template writes its own special tokens; a plain prompt gets the tokenizer's
        ids = tokenizer.encode_within(text, limit, add_special_tokens=spec.messages is None)
    except PromptTooLong as e:
        raise RequestError("prompt_too_long", f"the prompt has {e}, more than the limit of {limit} "
                           "(the model's context, or BATCHINFER_MAX_PROMPT_TOKENS); it was not tokenised "
                           "whole", field=field) from None
    except (TypeError, ValueError) as e:  # the tokenizers library refuses some strings
        raise RequestError("invalid_request", f"the prompt cannot be tokenised: {e}", field=field) from None
    if not ids:
        raise RequestError("invalid_request", "the prompt encodes to no tokens", field="prompt")
    return list(ids)


def render_chat(spec: RequestSpec, tokenizer: Tokenizer) -> str:
    """``spec.messages`` through the model's chat template, with ``spec.tools`` passed to it as
    transformers' ``apply_chat_template(tools=...)`` does (under ``tool_choice: "none"`` too, as
    vLLM: the model still sees what it may not call). Assistant ``tool_calls`` arguments reach the
    template as objects (``template_messages``), with or without tools."""
    assert spec.messages is not None
    try:
        messages = template_messages(spec.messages)
    except ValueError as e:  # "messages[3].tool_calls[0].function.arguments: not valid JSON ..."
        raise RequestError("invalid_request", str(e), field=str(e).partition(":")[0]) from None
    kwargs: dict[str, Any] = {}
    if spec.tools is not None:
        kwargs["tools"] = ToolSpec.from_dict(spec.tools).template_tools()
    try:
        return cast("str", tokenizer.apply_chat_template(messages, add_generation_prompt=True, **kwargs))
    except Exception as e:  # noqa: BLE001 - the template is the model's code: its failure is ours
        why = e if isinstance(e, ValueError) else repr(e)  # e.g. OverflowError of a too-big range()
        raise RequestError("invalid_request", f"cannot render the chat template: {why}",
                           field="messages") from None


def check_length(n: int, spec: RequestSpec, max_model_len: int, max_prompt_tokens: int | None) -> None:
    """A prompt of ``n`` tokens within the limit, leaving room for ``max_tokens`` in the context."""
    given = ("messages" if spec.messages is not None
             else "prompt_token_ids" if spec.prompt_token_ids is not None else "prompt")
    if max_prompt_tokens is not None and n > max_prompt_tokens:
        raise RequestError("prompt_too_long", f"the prompt has {n} tokens, more than the limit of "
                           f"{max_prompt_tokens} (BATCHINFER_MAX_PROMPT_TOKENS)", field=given)
    max_tokens = spec.sampling_params.max_tokens
    if n >= max_model_len:
        raise RequestError("prompt_too_long", f"the prompt has {n} tokens; the model's context is "
                           f"{max_model_len} tokens, which leaves no room to generate", field=given)
    if max_tokens is not None and n + max_tokens > max_model_len:
        raise RequestError("prompt_too_long", f"the prompt has {n} tokens and max_tokens is "
                           f"{max_tokens}: {n + max_tokens} > the model's context of {max_model_len} "
                           "tokens", field="max_tokens")
