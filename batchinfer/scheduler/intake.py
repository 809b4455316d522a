"""Intake: read the requests stream, validate, tokenise, and stage — or answer with an error row.
Each check of an entry (against its job, its model, its body) is a named function of
``batchinfer.scheduler.entry_checks``; embeddings requests are routed by the model's task and
tokenised per input in ``batchinfer.scheduler.embed_intake``.

Each intake entry ends in exactly one place, and its XACK + XDEL travels in the same MULTI:
a staging stream (valid; ``batchinfer.scheduler.staging``), the holding area (its model is not served yet),
or nowhere (an error / cancelled / expired row was published first, or a duplicate was dropped).
On start the scheduler first re-reads its own pending entries (read before a crash, not acked).

Job control entries (``op``: ``batchinfer.scheduler.jobops``) are applied in stream order: the
request entries read before one are settled first. The same MULTI that acks a job's request entry
sets its bit in ``{p}:admitted:<job>`` and counts it in the job's ``submitted`` (and its
``models_overridden`` / ``held``), so the counts stay exact across a crash: an entry re-read after
one was never counted. An entry that cannot be counted in its job (no such job, idx out of range or
taken already) is answered as a direct request: a ``protocol_error`` row in ``results:direct``
(and its ``reply_to``), plus a line in the job's ``errors`` when the job exists.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import redis

from batchinfer.clock import WALL_MS, WallClock
from batchinfer.config import Settings
from batchinfer.keys import SCHEDULER_GROUP, Keys
from batchinfer.protocol.bodies import RequestSpec, leading_custom_id, parse_body
from batchinfer.protocol.entries import IntakeEntry, RequestError, valid_job_id
from batchinfer.protocol.rows import BatchRequest, ResultRow, request_id_for
from batchinfer.redis_conn import ensure_group, read_group
from batchinfer.scheduler.embed_intake import check_task, embed_fields
from batchinfer.scheduler.entry_checks import (
    Duplicate,
    Hold,
    Outcome,
    Refuse,
    Reject,
    RowBase,
    Stage,
    check_entry,
    check_length,
    check_sampling_token_ids,
    check_sequences,
    check_size,
    ended_row,
    entry_ms,
    error_row,
    hold_deadline,
    malformed,
    prompt_limit,
    prompt_tokens,
    refusal,
    reply_stream,
    routable,
    run_model,
    unknown_adapter,
    unknown_line_model,
)
from batchinfer.scheduler.jobops import JobOps, bit_ops
from batchinfer.scheduler.lookups import JobCache, JobView, ModelCache, RowSink, ServedModel
from batchinfer.scheduler.staging import Staging, held_key
from batchinfer.scheduler.structured_check import StructuredCheck
from batchinfer.store import replies
from batchinfer.store.jobstore import JobField
from batchinfer.store.ownership import NotOwner, Ownership
from batchinfer.store.publish import Redelivery
from batchinfer.store.replies import Fields
from batchinfer.workers.sampling_params import SamplingParams

log = logging.getLogger(__name__)

IDEMPOTENCY_TTL_S = 24 * 3600
MAX_INTAKE_DELIVERIES = 5  # reads of one intake entry (after failures) before it is answered unrun
MAX_OVERRIDDEN_NAMES = 8  # distinct overridden line models a job record names
FIRST_CHUNK = 32  # new entries read after an idle read (then 64, 128, ... up to the chunk)
_Entry = tuple[bytes, Fields | None]  # a stream entry read back: id and fields (None: deleted)


@dataclass
class _Tally:
    """What one settle adds to each job's record (in the same MULTI as the acks)."""

    admitted: list[int] = field(default_factory=list)
    overridden: list[str] = field(default_factory=list)
    held: int = 0


# Fields left out of a batch element at their default (from_dict restores it), so that a line that
# does not use them is written as before speculative decoding and older workers read it unchanged.
_OMITTED_AT_DEFAULT = {"speculative": True, "prediction": None}


def params_dict(params: SamplingParams) -> dict[str, Any]:
    """``params.to_dict()`` without its deep copy (values are JSON-encoded right away), less the
    speculative-decoding fields at their defaults."""
    out = {name: getattr(params, name) for name in SamplingParams.FIELDS
           if name not in _OMITTED_AT_DEFAULT or getattr(params, name) != _OMITTED_AT_DEFAULT[name]}
    if params.structured_outputs is not None:  # a dataclass: its JSON form
        out["structured_outputs"] = params.structured_outputs.to_dict()
    return out


class Admission:
    """Decides the fate of one intake entry (reads job states and models through caches)."""

    def __init__(self, r: redis.Redis, keys: Keys, settings: Settings, jobs: JobCache, models: ModelCache,
                 direct_hold_s: float | None = None, clock: WallClock = WALL_MS):
        self.redis, self.keys, self.settings = r, keys, settings
        self.clock = clock  # holds are decided by it
        self.jobs, self.models = jobs, models
        self.direct_hold_s = settings.direct_hold_seconds if direct_hold_s is None else direct_hold_s
        self.duplicates = 0
        self.redelivery = Redelivery(r, keys)
        self.structured = StructuredCheck(settings)  # compiles output constraints before dispatch

    def admit(self, entry_id: str, fields: Fields, held_until: int | None = None,
              taken: set[tuple[str, int]] | frozenset[tuple[str, int]] = frozenset()) -> Outcome:
        """The outcome of entry ``entry_id`` (the original intake id, also for held entries); each
        check is named in ``batchinfer.scheduler.entry_checks`` (docs/scheduler.md, "Validation").

        ``taken``: the ``(job, idx)`` pairs already taken in (an entry for one is refused); a held
        entry (``held_until`` given) was taken in when it was held and is not checked again.
        """
        entry_id = self.keys.direct_id(entry_id)  # the request id a direct entry gets (with P > 1)
        try:
            entry = IntakeEntry.from_fields(fields)
            check_entry(entry, self.keys, self.settings.max_requests_per_job)
        except RequestError as e:
            return malformed(entry_id, routable(e, self.keys, self.settings.max_requests_per_job), self.jobs,
                             taken)
        request_id = request_id_for(entry.job_id, entry.idx, entry_id)
        base: RowBase = {"job_id": entry.job_id, "idx": entry.idx, "request_id": request_id,
                         "line": entry.line, "created_at": entry_ms(entry_id)}
        if entry.client_request_id and self._duplicate(entry.client_request_id, request_id, entry.reply_to,
                                                       entry.job_id):
            return Duplicate()
        view = self.jobs.get(entry.job_id) if entry.job_id else None
        if view is not None and held_until is None and (refused := refusal(
                entry_id, view, entry.idx, entry.reply_to, taken, entry.line, leading_custom_id(entry.body))):
            return refused
        if view and view.model:
            base["model"] = view.model  # error rows name the job's model until the body names one
        if (ended := ended_row(view, **base)) is not None:
            return Reject(self._identified(ended, entry), entry.reply_to)
        try:
            spec = self._parse(entry)
            check_sequences(spec, self.settings.max_n)
        except RequestError as e:
            return Reject(error_row(e.at_line(entry.line), base), entry.reply_to)
        base["custom_id"], base["metadata"], base["url"] = spec.custom_id, spec.metadata, spec.url
        if spec.model and (why := unknown_line_model(self.models, spec.model, view)) is not None:
            base["model"] = spec.model  # the row names what the line asked for: not the job's model
            return Reject(ResultRow.error("unknown_model", why, **base), entry.reply_to)
        model, overridden = run_model(self.models, spec.model, view, first_read=held_until is None)
        if not model:
            return Reject(ResultRow.error("invalid_request", "no model: give 'model' in the body or the job",
                                          **base), entry.reply_to)
        base["model"] = model
        served = self.models.get(model)
        if served is None:
            return self._unserved(entry, base, view, held_until, overridden)
        try:
            request = self._request(entry, spec, served, base)
        except RequestError as e:
            return Reject(error_row(e.at_line(entry.line), base), entry.reply_to, overridden)
        request.tenant = view.tenant if view else None  # packed in its tenant's fair-share group
        # staged under the canonical name: the tokens are that model's, whichever alias was asked for
        # (an adapter's, BASE:NAME, has its base's tokenizer and runs with lora NAME)
        priority = spec.priority or (view.priority if view else 0)
        if entry.priority is not None:  # the entry's own (a direct request's, e.g. the HTTP API's sync tier)
            priority = entry.priority
        return Stage(served.info.name, priority, request, overridden)

    def _parse(self, entry: IntakeEntry) -> RequestSpec:
        """The entry's body, within the line limit (any producer may XADD any size)."""
        check_size(entry.body, self.settings.max_line_bytes)
        return parse_body(entry.body, line=entry.line, max_tokens_limit=self.settings.max_tokens_limit)

    def _identified(self, row: ResultRow, entry: IntakeEntry) -> ResultRow:
        """``row`` (a ``cancelled`` / ``expired`` row, built before the body was read) with the
        body's ``custom_id``, ``metadata`` and ``url``, as the request's row would have had them: a
        producer matches rows by ``custom_id``. An invalid body keeps what its error names."""
        try:
            spec = self._parse(entry)
        except RequestError as e:
            found = e.context.get("custom_id") or leading_custom_id(entry.body)
            row.custom_id = found if isinstance(found, str) else None
            return row
        row.custom_id, row.metadata, row.url = spec.custom_id, dict(spec.metadata), spec.url
        return row

    def _unserved(self, entry: IntakeEntry, base: RowBase, view: JobView | None, held_until: int | None,
                  overridden: str | None) -> Hold | Reject:
        """A request for a model no worker serves: held until its deadline, unless it names an adapter
        of a served model (no worker starting later is waited for)."""
        model = base["model"]
        if (why := unknown_adapter(self.models, model)) is not None:
            return Reject(ResultRow.error("unknown_model", why, **base), entry.reply_to, overridden)
        now = self.clock()
        deadline = held_until or hold_deadline(view, now, entry.hold_seconds, self.direct_hold_s)
        row = ResultRow.error("unknown_model", f"model {model!r} is not served by any worker", **base)
        if now < deadline:
            return Hold(deadline, row, entry.reply_to, model, overridden)
        return Reject(row, entry.reply_to, overridden)

    def _request(self, entry: IntakeEntry, spec: RequestSpec, served: ServedModel,
                 base: RowBase) -> BatchRequest:
        """The request to stage, checked against its model: routing by task (embeddings to embedding
        models only), then tokens, context and output constraints (a schema / regex that cannot be
        served gets its row now)."""
        token_ids: list[int] = []
        embed: dict[str, Any] = {}  # an embedding request's task, inputs and pooling_params
        check_task(spec, base["model"], served.info)
        if spec.task == "embed":
            embed = embed_fields(spec, served, self.settings.max_prompt_tokens)
        else:
            limit = prompt_limit(served.info.max_model_len, self.settings.max_prompt_tokens)
            token_ids = prompt_tokens(spec, served.tokenizer, limit)
            check_length(len(token_ids), spec, served.info.max_model_len, self.settings.max_prompt_tokens)
            check_sampling_token_ids(spec, served.tokenizer)
            self.structured.check(spec, served)
        sampling = {} if embed else params_dict(spec.sampling_params)
        return BatchRequest(request_id=base["request_id"], job_id=entry.job_id, idx=entry.idx,
                            prompt_token_ids=token_ids, sampling_params=sampling, model=base["model"],
                            line=entry.line, custom_id=spec.custom_id, url=spec.url, reply_to=entry.reply_to,
                            metadata=spec.metadata, created_at=base["created_at"], lora=served.info.adapter,
                            tools=spec.tools, **embed)

    def _duplicate(self, client_request_id: str, request_id: str, reply_to: str | None,
                   job_id: str | None) -> bool:
        """Claim the idempotency key (a re-read of our own entry after a crash is no duplicate); a
        duplicate's ``reply_to`` gets the first request's row, now or when it is published."""
        first = self.redelivery.claim(client_request_id, request_id, reply_to, IDEMPOTENCY_TTL_S, job_id)
        if first == request_id:
            return False
        self.duplicates += 1
        delivery = self.redelivery.redeliver(first, reply_to, job_id) if reply_to else "no reply_to"
        log.log(logging.WARNING if delivery == "wrongtype" else logging.INFO,
                "dropped request %s: client_request_id %r was already accepted for %s (its row to %s: %s)",
                request_id, client_request_id, first, reply_to,
                "not a stream: not written" if delivery == "wrongtype" else delivery)
        return True


class Intake:
    """Moves entries from ``{p}:requests`` (and the holding area) to staging or to rows."""

    def __init__(self, r: redis.Redis, keys: Keys, admission: Admission, staging: Staging, sink: RowSink,
                 consumer: str, fence: Ownership, chunk: int = 256, held_limit: int = 100_000):
        """``fence``: the transactions that move entries run only while this scheduler is the owner."""
        self.redis, self.keys, self.admission, self.staging, self.sink = r, keys, admission, staging, sink
        self.fence = fence
        self.consumer, self.chunk, self.held_limit = consumer, chunk, held_limit
        # New entries are read in chunks that start small after an idle read and double up to
        # `chunk` (slow start): the first requests of a job reach staging, and so a worker, after
        # FIRST_CHUNK entries' intake rather than a whole chunk's (docs/scheduler.md).
        self.next_chunk = min(FIRST_CHUNK, chunk)
        self.recovered = False  # own pending entries re-read since (re)start
        self.held_cursor = "-"
        self.ops = JobOps(r, keys, admission.jobs, sink)
        # per job, the overridden line models its record names (read once per job after a restart)
        self._overridden_names: dict[str, list[str]] = {}

    def ensure_group(self) -> None:
        ensure_group(self.redis, self.keys.requests, SCHEDULER_GROUP)

    def step(self, block_ms: int | None = None) -> int:
        """Read and settle one chunk of entries (own pending ones first); returns how many were read.

        Own pending entries exist only after a failure (a crash, or a pass that raised): they are
        settled one at a time, so that an entry that fails its pass is found and the others go on,
        and one read ``MAX_INTAKE_DELIVERIES`` times is answered without being admitted again: no
        entry is retried forever, and none holds up the entries behind it."""
        entries: list[_Entry] = []
        recovering = not self.recovered
        if recovering:
            entries = self._read("0", None)
            self.recovered = len(entries) < self.chunk  # the last chunk of own pending entries
            entries = self._answer_poisoned(entries)
        if not entries:
            recovering = False
            entries = self._read(">", block_ms, count=self.next_chunk)
            self.next_chunk = min(self.chunk, self.next_chunk * 2 if entries else FIRST_CHUNK)
        if not entries:
            return 0
        # Job ops apply in stream order: the request entries before one are settled first.
        run: list[_Entry] = []
        ops = 0
        for eid, f in entries:
            if f and b"op" in f:
                ops += 1
                self._take_in(run)
                run = []
                self.ops.apply(eid.decode(), f)
                pipe = self.fence.transaction()
                pipe.xack(self.keys.requests, SCHEDULER_GROUP, eid)
                pipe.xdel(self.keys.requests, eid)
                pipe.execute()
            elif recovering:
                self._take_in_alone(eid, f)
            else:
                run.append((eid, f))
        self._take_in(run)
        if self.sink.metrics is not None:
            self.sink.metrics.intake_read(len(entries) - ops)  # requests; job ops are not requests
        return len(entries)

    def _take_in(self, run: list[_Entry]) -> None:
        """Admit and settle a run of request entries."""
        if not run:
            return
        taken = self._taken([f for _, f in run if f])
        decided: list[tuple[str, Outcome, Fields]] = []
        for eid, f in run:
            if not f:  # an entry someone XDELed while it was pending comes back without fields: just ack it
                continue
            outcome = self._admit(eid.decode(), f, taken=taken)
            key = _counted_in(outcome)
            if key is not None:
                taken.add(key)  # a second entry for the same idx in this run is refused
            decided.append((eid.decode(), outcome, f))
        self._settle(decided, [eid.decode() for eid, _ in run], source=self.keys.requests)

    def _take_in_alone(self, eid: bytes, f: Fields | None) -> None:
        """Settle one own pending entry; one that fails stays pending (its delivery count grows at
        every re-read) and the pending entries are read again on the next step."""
        try:
            self._take_in([(eid, f)])
        except (redis.ConnectionError, redis.TimeoutError, NotOwner, redis.WatchError):
            raise  # an outage, or another scheduler took over: not this entry's fault
        except Exception:  # noqa: BLE001 - found the entry that fails a pass: the others go on
            log.exception("intake entry %s failed its settle alone; it is re-read and, after %d reads, "
                          "answered without admission", eid.decode(), MAX_INTAKE_DELIVERIES)
            self.recovered = False

    def _answer_poisoned(self, entries: list[_Entry]) -> list[_Entry]:
        """The own pending ``entries`` left to settle: those now read more than ``MAX_INTAKE_DELIVERIES``
        times get an ``internal_error`` row (``results:direct``, a line in their job's errors) and
        are acked, whatever they hold."""
        if not entries:
            return entries
        reads = replies.delivery_counts(self.redis.xpending_range(
            self.keys.requests, SCHEDULER_GROUP, min=entries[0][0], max=entries[-1][0], count=len(entries),
            consumername=self.consumer))
        keep: list[_Entry] = []
        for eid, f in entries:
            if reads.get(eid, 0) <= MAX_INTAKE_DELIVERIES:
                keep.append((eid, f))
                continue
            entry_id = eid.decode()
            job = _job_idx(f or {}, self.admission.settings.max_requests_per_job)
            where = f" (job {job[0]!r}, idx {job[1]})" if job else ""
            message = (f"this entry was read {reads[eid]} times and never settled (the scheduler failed on "
                       f"it each time); it was not run{where}")
            log.error("intake entry %s: %s", entry_id, message)
            row = ResultRow.error("internal_error", message, job_id=None,
                                  request_id=self.keys.direct_id(entry_id), created_at=entry_ms(entry_id))
            try:
                self._publish(entry_id, Reject(row, None))
                if job:
                    self.ops.job_error(job[0], f"entry {entry_id}: {message}")
            except (redis.ConnectionError, redis.TimeoutError):
                raise
            except Exception:  # noqa: BLE001 - acked all the same: it must not come back
                log.exception("intake entry %s: its internal_error row could not be written", entry_id)
            pipe = self.fence.transaction()
            pipe.xack(self.keys.requests, SCHEDULER_GROUP, eid)
            pipe.xdel(self.keys.requests, eid)
            pipe.execute()
        return keep

    def _taken(self, fields: list[Fields]) -> set[tuple[str, int]]:
        """The ``(job, idx)`` of these entries already taken in (a GETBIT each, in one round trip).
        Only pairs that pass the entry checks are looked up; any other is checked later, alone."""
        limit = self.admission.settings.max_requests_per_job
        pairs = list(dict.fromkeys(p for p in (_job_idx(f, limit) for f in fields) if p is not None))
        if not pairs:
            return set()
        by_job: dict[str, list[int]] = {}
        for job, idx in pairs:
            by_job.setdefault(job, []).append(idx)
        # one BITFIELD reads a job's bits (a GETBIT each cost the scheduler more than the read)
        pipe = self.redis.pipeline(transaction=False)
        for job, idxs in by_job.items():
            pipe.execute_command("BITFIELD", self.keys.admitted(job), *bit_ops("GET", idxs))
        answers = pipe.execute(raise_on_error=False)  # e.g. WRONGTYPE: that job's pairs are not taken
        taken: set[tuple[str, int]] = set()
        for (job, idxs), bits in zip(by_job.items(), answers, strict=True):
            if isinstance(bits, list):
                taken.update((job, idx) for idx, bit in zip(idxs, bits, strict=True) if bit == 1)
        return taken

    def _read(self, start: str, block_ms: int | None, count: int | None = None) -> list[_Entry]:
        """One chunk of entries (``count``, default ``chunk``) from ``start`` (``"0"``: own pending
        ones, which may have lost their fields; ``">"``: new ones)."""
        reply = read_group(self.redis, self.keys.requests, SCHEDULER_GROUP, self.consumer, start,
                           count=count or self.chunk, block_ms=block_ms)
        streams = replies.read_pending(reply)
        return streams[0][1] if streams else []

    def sweep_held(self, count: int = 500) -> int:
        """Re-decide up to ``count`` held entries (model now served? waited too long?)."""
        held = held_key(self.keys)
        entries = replies.entries(self.redis.xrange(held, min=self.held_cursor, count=count))
        self.held_cursor = "-" if len(entries) < count else "(" + entries[-1][0].decode()
        return self.redecide_held(entries)

    def redecide_held(self, entries: list[replies.Entry]) -> int:
        """Re-decide these held entries (as read from ``{p}:held``); returns how many left it. The
        sweep's path, also taken for the held requests of a cancelled or expired job at once
        (``batchinfer.scheduler.accounting.Settler``)."""
        held = held_key(self.keys)
        decided: list[tuple[str, Outcome, Fields]] = []
        done: list[str] = []
        released: list[tuple[str | None, str]] = []
        for eid, fields in entries:
            fields = dict(fields)
            origin = fields.pop(b"held_from", eid).decode()
            until = int(fields.pop(b"held_until", b"0"))
            held_model = fields.pop(b"held_model", None)  # absent in entries held before it was counted
            outcome = self._admit(origin, fields, held_until=until)
            if not isinstance(outcome, Hold):
                decided.append((origin, outcome, fields))
                done.append(eid.decode())
                if held_model is not None:
                    job = fields.get(b"job")
                    released.append((job.decode() if job else None, held_model.decode()))
        self._settle(decided, done, source=held, released=released)
        return len(done)

    def _admit(self, entry_id: str, fields: Fields, held_until: int | None = None,
               taken: set[tuple[str, int]] | frozenset[tuple[str, int]] = frozenset()) -> Outcome:
        try:
            return self.admission.admit(entry_id, fields, held_until=held_until, taken=taken)
        except (redis.ConnectionError, redis.TimeoutError):
            raise
        except Exception as e:  # one bad entry never stops the scheduler
            log.exception("intake entry %s could not be handled", entry_id)
            try:
                entry = IntakeEntry.from_fields(fields)
                job, idx = entry.job_id, entry.idx
                reply_to = reply_stream(self.keys, entry.reply_to, self.keys.job_partition(job))
            except RequestError:
                job = idx = reply_to = None
            row = ResultRow.error("internal_error", f"the scheduler failed on this entry: {e!r}", job_id=job,
                                  idx=idx, request_id=request_id_for(job, idx, self.keys.direct_id(entry_id)),
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

    def _settle(self, decided: list[tuple[str, Outcome, Fields]], done: list[str], source: str,
                released: list[tuple[str | None, str]] | None = None) -> None:
        """Publish rejections, then one MULTI: stage / hold, the job counters (entries from the intake
        stream; ``released`` held ones), and XACK + XDEL ``done`` from ``source``."""
        held = held_key(self.keys)
        intake = source == self.keys.requests
        room = self.held_limit - self.redis.xlen(held) if source != held else 0
        pipe = self.fence.transaction()
        tallies: dict[str, _Tally] = {}
        held_models: Counter[str] = Counter()  # model -> requests held (+) or released (-)
        staged: list[tuple[str, int, BatchRequest]] = []
        for entry_id, outcome, fields in decided:
            if isinstance(outcome, Hold) and room <= 0:
                outcome.row.error_message = ((outcome.row.error_message or "")
                                             + " (and the holding area for unknown models is full)")
                outcome = Reject(outcome.row, outcome.reply_to, outcome.overridden)
            if isinstance(outcome, Refuse):
                self._refuse(entry_id, outcome)
                continue
            if isinstance(outcome, Reject):
                self._publish(entry_id, outcome)
            elif isinstance(outcome, Stage):
                staged.append((outcome.model, outcome.priority, outcome.request))
            elif isinstance(outcome, Hold):
                room -= 1
                # str values as redis-py would encode them (UTF-8), so the map is all bytes
                pipe.xadd(held, replies.xadd_fields({**fields, b"held_from": entry_id.encode(),
                                                     b"held_until": str(outcome.until).encode(),
                                                     b"held_model": outcome.model.encode()}))
                held_models[outcome.model] += 1
            key = _counted_in(outcome) if intake else None
            if key is not None:
                tally = tallies.setdefault(key[0], _Tally())
                tally.admitted.append(key[1])
                tally.held += isinstance(outcome, Hold)
                if isinstance(outcome, Stage | Reject | Hold) and outcome.overridden:
                    tally.overridden.append(outcome.overridden)
        self.staging.add(pipe, staged)
        self._count(pipe, tallies)
        released_jobs: Counter[str] = Counter()
        for job, model in released or ():
            held_models[model] -= 1
            if job:
                released_jobs[job] += 1
        for job, n in released_jobs.items():
            pipe.hincrby(self.keys.job(job), JobField.HELD, -n)
        for model, n in held_models.items():
            if n:
                pipe.hincrby(self.keys.held_models, model, n)
        if done:
            if source == self.keys.requests:
                pipe.xack(source, SCHEDULER_GROUP, *done)
            pipe.xdel(source, *done)
        pipe.execute()

    def _count(self, pipe: redis.client.Pipeline, tallies: dict[str, _Tally]) -> None:
        """Queue each job's counter updates on ``pipe``: admitted bits, ``submitted``, ``held`` and the
        overridden line models (their names only when a new one appears, at most 8)."""
        for job, tally in tallies.items():
            key = self.keys.job(job)
            if tally.admitted:  # every bit in one BITFIELD, not a SETBIT each
                pipe.execute_command("BITFIELD", self.keys.admitted(job), *bit_ops("SET", tally.admitted))
            pipe.hincrby(key, JobField.SUBMITTED, len(tally.admitted))
            if tally.held:
                pipe.hincrby(key, JobField.HELD, tally.held)
            if tally.overridden:
                pipe.hincrby(key, JobField.MODELS_OVERRIDDEN, len(tally.overridden))
                names = self._names(job)
                fresh = [m for m in dict.fromkeys(tally.overridden) if m not in names]
                if fresh and len(names) < MAX_OVERRIDDEN_NAMES:
                    names += fresh[:MAX_OVERRIDDEN_NAMES - len(names)]
                    pipe.hset(key, JobField.OVERRIDDEN_MODELS, json.dumps(names, ensure_ascii=False))

    def _names(self, job: str) -> list[str]:
        """The overridden model names job ``job``'s record lists (read from Redis once per process)."""
        names = self._overridden_names.get(job)
        if names is None:
            if len(self._overridden_names) > 10_000:
                self._overridden_names.clear()  # bounded memory; a miss costs one HGET
            raw = self.redis.hget(self.keys.job(job), JobField.OVERRIDDEN_MODELS)
            try:
                names = [str(n) for n in json.loads(raw)] if raw else []
            except (ValueError, TypeError):
                names = []
            self._overridden_names[job] = names
        return names

    def _refuse(self, entry_id: str, outcome: Refuse) -> None:
        """Answer an entry its job cannot count: a direct row, and a line in the job's ``errors``."""
        log.warning("intake entry %s refused: %s", entry_id, outcome.row.error_message)
        self._publish(entry_id, Reject(outcome.row, outcome.reply_to))
        if outcome.job_id and outcome.job_error:
            self.ops.job_error(outcome.job_id, f"entry {entry_id}: {outcome.job_error}")


def _job_idx(fields: Fields, max_requests: int) -> tuple[str, int] | None:
    """The ``(job, idx)`` a raw entry names, when both are valid: a job id, an idx in
    ``[0, max_requests)`` (else None: the entry checks answer it). Nothing unchecked reaches Redis."""
    job, idx = fields.get(b"job"), fields.get(b"idx")
    if not job or idx is None or len(idx) > 20:
        return None
    try:
        job_id, i = job.decode(), int(idx)
    except (UnicodeDecodeError, ValueError):
        return None
    return (job_id, i) if valid_job_id(job_id) and 0 <= i < max_requests else None


def _counted_in(outcome: Outcome) -> tuple[str, int] | None:
    """``(job, idx)`` when ``outcome`` is counted in a job: staged, held, or a row in the job."""
    if isinstance(outcome, Stage):
        request = outcome.request
        job, idx = request.job_id, request.idx
    elif isinstance(outcome, Reject | Hold):
        job, idx = outcome.row.job_id, outcome.row.idx
    else:
        return None
    return (job, idx) if job and idx is not None else None
