"""Intake: read the requests stream, validate, tokenise, and stage — or answer with an error row.

Each intake entry ends in exactly one place, and its XACK + XDEL travels in the same MULTI:
a staging stream (valid; ``batchinfer.scheduler.staging``), the holding area (its model is not served yet),
or nowhere (an error / cancelled / expired row was published first, or a duplicate was dropped).
On start the scheduler first re-reads its own pending entries (read before a crash, not acked).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, TypedDict, cast

import redis

from batchinfer.config import Settings
from batchinfer.keys import SCHEDULER_GROUP, Keys
from batchinfer.protocol.bodies import RequestSpec, leading_custom_id, parse_body
from batchinfer.protocol.entries import IntakeEntry, RequestError, valid_job_id
from batchinfer.protocol.rows import BatchRequest, ResultRow, now_ms, request_id_for
from batchinfer.redis_conn import as_text, ensure_group, read_group
from batchinfer.scheduler.lookups import JobCache, JobView, ModelCache, RowSink
from batchinfer.scheduler.staging import Staging, held_key
from batchinfer.store import replies
from batchinfer.store.replies import Fields
from batchinfer.workers.sampling_params import SamplingParams
from batchinfer.workers.text.tokenizer import Tokenizer

log = logging.getLogger(__name__)

IDEMPOTENCY_TTL_S = 24 * 3600
DEFAULT_WINDOW_S = 24 * 3600  # how long a job without expires_at waits for an unknown model


@dataclass
class Stage:
    model: str
    priority: int
    request: BatchRequest


@dataclass
class Reject:
    row: ResultRow
    reply_to: str | None


@dataclass
class Hold:
    until: int  # ms: when the request gives up waiting for its model
    row: ResultRow  # its unknown_model row, for then (or for a full holding area)
    reply_to: str | None


class Duplicate:
    """An entry whose client_request_id was already accepted for another request."""


Outcome = Stage | Reject | Hold | Duplicate


class _RowIds(TypedDict):
    """What every error row of an entry names (keyword arguments of ``ResultRow.error``)."""

    job_id: str | None
    idx: int | None
    request_id: str
    line: int | None
    created_at: int


class _RowBase(_RowIds, total=False):
    """Plus what is known once the job and the body have been read."""

    model: str
    custom_id: str | None
    metadata: dict[str, str]
    url: str | None


def params_dict(params: SamplingParams) -> dict[str, Any]:
    """``params.to_dict()`` without its deep copy (values are JSON-encoded right away)."""
    return {name: getattr(params, name) for name in SamplingParams.FIELDS}


def entry_ms(entry_id: str) -> int:
    return int(entry_id.split("-", 1)[0])


class Admission:
    """Decides the fate of one intake entry (reads job states and models through caches)."""

    def __init__(self, r: redis.Redis, keys: Keys, settings: Settings, jobs: JobCache, models: ModelCache,
                 direct_hold_s: float = 600.0):
        self.redis, self.keys, self.settings = r, keys, settings
        self.jobs, self.models, self.direct_hold_s = jobs, models, direct_hold_s
        self.duplicates = 0

    def admit(self, entry_id: str, fields: Fields, held_until: int | None = None) -> Outcome:
        """The outcome of entry ``entry_id`` (the original intake id, also for held entries)."""
        try:
            entry = IntakeEntry.from_fields(fields)
        except RequestError as e:
            return self._malformed(entry_id, e)
        request_id = request_id_for(entry.job_id, entry.idx, entry_id)
        base: _RowBase = {"job_id": entry.job_id, "idx": entry.idx, "request_id": request_id,
                          "line": entry.line, "created_at": entry_ms(entry_id)}
        if entry.client_request_id and self._duplicate(entry.client_request_id, request_id):
            return Duplicate()
        now = now_ms()
        view = self.jobs.get(entry.job_id) if entry.job_id else None
        ended = view.ended_as() if view else None
        if view and view.model:
            base["model"] = view.model  # error rows name the job's model until the body names one
        if ended:
            return Reject(ResultRow.error(ended, f"the job was {ended} before this request ran", status=ended,
                                          **base), entry.reply_to)
        try:
            self._check_size(entry.body)
            spec = parse_body(entry.body, line=entry.line, max_tokens_limit=self.settings.max_tokens_limit)
        except RequestError as e:
            return Reject(self._error(e.at_line(entry.line), base), entry.reply_to)
        base["custom_id"], base["metadata"], base["url"] = spec.custom_id, spec.metadata, spec.url
        model = spec.model or (view.model if view else None)
        if not model:
            return Reject(ResultRow.error("invalid_request", "no model: give 'model' in the body or the job",
                                          **base), entry.reply_to)
        base["model"] = model
        served = self.models.get(model)
        if served is None:
            deadline = held_until or self._deadline(view, now)
            row = ResultRow.error("unknown_model", f"model {model!r} is not served by any worker", **base)
            return Hold(deadline, row, entry.reply_to) if now < deadline else Reject(row, entry.reply_to)
        try:
            token_ids = self._tokens(spec, served.tokenizer)
            self._check_length(len(token_ids), spec, served.info.max_model_len,
                               self.settings.max_prompt_tokens)
        except RequestError as e:
            return Reject(self._error(e.at_line(entry.line), base), entry.reply_to)
        priority = spec.priority or (view.priority if view else 0)
        request = BatchRequest(request_id=request_id, job_id=entry.job_id, idx=entry.idx,
                               prompt_token_ids=token_ids, sampling_params=params_dict(spec.sampling_params),
                               model=model, line=entry.line, custom_id=spec.custom_id, url=spec.url,
                               reply_to=entry.reply_to, metadata=spec.metadata, created_at=base["created_at"])
        return Stage(model, priority, request)

    def _malformed(self, entry_id: str, e: RequestError) -> Reject:
        """An entry that is not a valid intake entry: its row goes to its job if one can be read."""
        ctx = e.context
        job, idx = ctx.get("job"), ctx.get("idx")
        routable = isinstance(job, str) and valid_job_id(job) and isinstance(idx, int) and idx >= 0
        base: _RowBase = {"job_id": job if routable else None, "idx": idx if routable else None,
                          "request_id": request_id_for(job, idx) if routable else entry_id,
                          "line": ctx.get("line"), "created_at": entry_ms(entry_id)}
        return Reject(self._error(e, base), ctx.get("reply_to"))

    @staticmethod
    def _error(e: RequestError, base: _RowBase) -> ResultRow:
        message = f"{e.field}: {e.message}" if e.field and e.field not in e.message else e.message
        row = base.copy()
        row["line"] = e.line or base["line"]
        row["custom_id"] = base.get("custom_id") or e.context.get("custom_id")
        return ResultRow.error(e.code, message, **row)

    def _check_size(self, body: str) -> None:
        """Producers other than the submitter may XADD any size: the line limit holds for them too."""
        limit = self.settings.max_line_bytes
        # len() counts characters; only text that might be over the limit is encoded to count bytes
        if len(body) > limit or (4 * len(body) > limit and len(body.encode("utf-8", "replace")) > limit):
            custom_id = leading_custom_id(body)  # cheap: the rest of the body is never parsed
            raise RequestError("line_too_long", f"body is {len(body.encode('utf-8', 'replace'))} bytes, more "
                               f"than the limit of {limit} bytes (BATCHINFER_MAX_LINE_BYTES)", field="body",
                               context={"custom_id": custom_id} if custom_id else None)

    def _duplicate(self, client_request_id: str, request_id: str) -> bool:
        """SET NX the idempotency key; a re-read of our own entry (after a crash) is no duplicate."""
        key = self.keys.idempotency(client_request_id)
        if self.redis.set(key, request_id, nx=True, ex=IDEMPOTENCY_TTL_S):
            return False
        first = as_text(self.redis.get(key))
        if first is None or first == request_id:
            return False
        self.duplicates += 1
        log.info("dropped request %s: client_request_id %r was already accepted for %s",
                 request_id, client_request_id, first)
        return True

    def _deadline(self, view: JobView | None, now: int) -> int:
        if view is None:
            return now + int(self.direct_hold_s * 1000)
        return view.expires_at or now + DEFAULT_WINDOW_S * 1000

    @staticmethod
    def _tokens(spec: RequestSpec, tokenizer: Tokenizer) -> list[int]:
        if spec.prompt_token_ids is not None:
            vocab = tokenizer.vocab_size
            for i, t in enumerate(spec.prompt_token_ids):
                if t >= vocab:
                    raise RequestError("invalid_request", f"token id {t} is outside the model's vocabulary "
                                       f"of {vocab} tokens", field=f"prompt_token_ids[{i}]")
            return list(spec.prompt_token_ids)
        ids: list[int]
        if spec.messages is not None:
            try:
                rendered = tokenizer.apply_chat_template(spec.messages, add_generation_prompt=True,
                                                         tokenize=True)
                ids = cast("list[int]", rendered)  # tokenize=True: ids, not text
            except Exception as e:  # noqa: BLE001 - the template is the model's code: its failure is ours
                why = e if isinstance(e, ValueError) else repr(e)  # e.g. OverflowError of a too-big range()
                raise RequestError("invalid_request", f"cannot render the chat template: {why}",
                                   field="messages") from None
        else:
            assert spec.prompt is not None  # a RequestSpec holds exactly one of the three
            try:
                ids = tokenizer.encode(spec.prompt)
            except (TypeError, ValueError) as e:  # the tokenizers library refuses some strings
                raise RequestError("invalid_request", f"the prompt cannot be tokenised: {e}",
                                   field="prompt") from None
        if not ids:
            raise RequestError("invalid_request", "the prompt encodes to no tokens", field="prompt")
        return list(ids)

    @staticmethod
    def _check_length(n: int, spec: RequestSpec, max_model_len: int, max_prompt_tokens: int | None) -> None:
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


class Intake:
    """Moves entries from ``{p}:requests`` (and the holding area) to staging or to rows."""

    def __init__(self, r: redis.Redis, keys: Keys, admission: Admission, staging: Staging, sink: RowSink,
                 consumer: str, chunk: int = 256, held_limit: int = 100_000):
        self.redis, self.keys, self.admission, self.staging, self.sink = r, keys, admission, staging, sink
        self.consumer, self.chunk, self.held_limit = consumer, chunk, held_limit
        self.recovered = False  # own pending entries re-read since (re)start
        self.held_cursor = "-"

    def ensure_group(self) -> None:
        ensure_group(self.redis, self.keys.requests, SCHEDULER_GROUP)

    def step(self, block_ms: int | None = None) -> int:
        """Read and settle one chunk of entries (own pending ones first); returns how many were read."""
        entries: list[tuple[bytes, Fields | None]] = []
        if not self.recovered:
            entries = self._read("0", None)
            self.recovered = len(entries) < self.chunk  # the last chunk of own pending entries
        if not entries:
            entries = self._read(">", block_ms)
        if not entries:
            return 0
        # an entry someone XDELed while it was pending comes back without fields: just ack it
        decided = [(eid.decode(), self._admit(eid.decode(), f), f) for eid, f in entries if f]
        self._settle(decided, [eid.decode() for eid, _ in entries], source=self.keys.requests)
        if self.sink.metrics is not None:
            self.sink.metrics.intake_read(len(entries))
        return len(entries)

    def _read(self, start: str, block_ms: int | None) -> list[tuple[bytes, Fields | None]]:
        """One chunk of entries from ``start`` (``"0"``: own pending ones, which may have lost their
        fields; ``">"``: new ones)."""
        reply = read_group(self.redis, self.keys.requests, SCHEDULER_GROUP, self.consumer, start,
                           count=self.chunk, block_ms=block_ms)
        streams = replies.read_pending(reply)
        return streams[0][1] if streams else []

    def sweep_held(self, count: int = 500) -> int:
        """Re-decide up to ``count`` held entries (model now served? waited too long?)."""
        held = held_key(self.keys)
        entries = replies.entries(self.redis.xrange(held, min=self.held_cursor, count=count))
        self.held_cursor = "-" if len(entries) < count else "(" + entries[-1][0].decode()
        decided: list[tuple[str, Outcome, Fields]] = []
        done: list[str] = []
        for eid, fields in entries:
            fields = dict(fields)
            origin = fields.pop(b"held_from", eid).decode()
            until = int(fields.pop(b"held_until", b"0"))
            outcome = self._admit(origin, fields, held_until=until)
            if not isinstance(outcome, Hold):
                decided.append((origin, outcome, fields))
                done.append(eid.decode())
        self._settle(decided, done, source=held)
        return len(done)

    def _admit(self, entry_id: str, fields: Fields, held_until: int | None = None) -> Outcome:
        try:
            return self.admission.admit(entry_id, fields, held_until=held_until)
        except (redis.ConnectionError, redis.TimeoutError):
            raise
        except Exception as e:  # one bad entry never stops the scheduler
            log.exception("intake entry %s could not be handled", entry_id)
            try:
                entry = IntakeEntry.from_fields(fields)
                job, idx, reply_to = entry.job_id, entry.idx, entry.reply_to
            except RequestError:
                job = idx = reply_to = None
            row = ResultRow.error("internal_error", f"the scheduler failed on this entry: {e!r}", job_id=job,
                                  idx=idx, request_id=request_id_for(job, idx, entry_id),
                                  created_at=entry_ms(entry_id))
            return Reject(row, reply_to)

    def _publish(self, entry_id: str, outcome: Reject) -> None:
        """Publish a rejection; a row that cannot be written (e.g. text that is not Unicode) is replaced
        by a bare ``internal_error`` row, so that one entry never wedges the intake."""
        try:
            self.sink.publish(outcome.row, outcome.reply_to)
        except (redis.ConnectionError, redis.TimeoutError):
            raise
        except Exception as e:  # noqa: BLE001
            log.exception("intake entry %s: its error row could not be published", entry_id)
            row = outcome.row
            bare = ResultRow.error("internal_error", f"the error row of this request could not be written "
                                   f"({e!r}); it was: {row.error_code}", job_id=row.job_id, idx=row.idx,
                                   request_id=row.request_id, line=row.line, created_at=row.created_at)
            self.sink.publish(bare, outcome.reply_to)

    def _settle(self, decided: list[tuple[str, Outcome, Fields]], done: list[str], source: str) -> None:
        """Publish rejections, then one MULTI: stage / hold, and XACK + XDEL ``done`` from ``source``."""
        held = held_key(self.keys)
        room = self.held_limit - self.redis.xlen(held) if source != held else 0
        pipe = self.redis.pipeline(transaction=True)
        for entry_id, outcome, fields in decided:
            if isinstance(outcome, Hold) and room <= 0:
                outcome.row.error_message = ((outcome.row.error_message or "")
                                             + " (and the holding area for unknown models is full)")
                outcome = Reject(outcome.row, outcome.reply_to)
            if isinstance(outcome, Reject):
                self._publish(entry_id, outcome)
            elif isinstance(outcome, Stage):
                self.staging.add(pipe, outcome.model, outcome.priority, outcome.request)
            elif isinstance(outcome, Hold):
                room -= 1
                # str values as redis-py would encode them (UTF-8), so the map is all bytes
                pipe.xadd(held, replies.xadd_fields({**fields, b"held_from": entry_id.encode(),
                                                     b"held_until": str(outcome.until).encode()}))
        if done:
            if source == self.keys.requests:
                pipe.xack(source, SCHEDULER_GROUP, *done)
            pipe.xdel(source, *done)
        pipe.execute()
