"""Job accounting: expiry by completion window, the export safety net, and settling ended jobs.

Walks ``{p}:jobs`` a chunk per pass (bounded work however many jobs exist):

- a ``validating`` / ``in_progress`` job past ``expires_at`` becomes ``expired`` and joins
  ``{p}:cancelled`` (workers abort its running requests with ``expired`` rows; the scheduler
  answers its pending ones the same way). A job still ``validating`` gets ``total = submitted``:
  its submitter is gone and nothing more will arrive in time. Its rows in, it is exported with
  its partial results and stays ``expired``. (A job whose last row lands after ``expires_at``
  but before this sweep noticed, e.g. the ``unknown_model`` rows of requests held until the
  window's end, is made ``expired`` by ``maybe_finalize`` itself, in ``store/lua/finalize.lua``.)
- a job whose every row is in (``export_requested_at`` set by the publish script) but that has
  no export job in rq and no ``exported_at`` after a grace period gets its export enqueued
  (the process that finalized it may have died before enqueueing).
- a job cancelled while still being submitted (no ``total``; e.g. the submitter was interrupted)
  gets ``total = submitted`` after a minute, so it can finish ``cancelled``.
- cancels of direct requests (``{p}:cancelled:requests``) older than an hour are trimmed: by then
  their requests have their rows, and workers and dispatch ignore them already.

:class:`Settler` (run right after the sweep) answers the requests of cancelled and expired jobs
that no live worker holds, at once, so that a job never waits for a worker that is not there.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import redis

from batchinfer.clock import WALL_MS, WallClock
from batchinfer.config import Settings
from batchinfer.keys import WORKERS_GROUP, Keys
from batchinfer.protocol.batches import MalformedBatch, decode
from batchinfer.protocol.entries import CANCEL_KEEP_SECONDS
from batchinfer.protocol.rows import BatchRequest, ResultRow
from batchinfer.redis_conn import as_text
from batchinfer.scheduler.lookups import JobCache, RowSink
from batchinfer.store import replies, scripts
from batchinfer.store.jobstore import JobField, JobStatus, JobStore, parse_fields
from batchinfer.store.registry import Registry

if TYPE_CHECKING:
    from batchinfer.scheduler.intake import Intake

log = logging.getLogger(__name__)

EXPORT_GRACE_MS = 30_000  # time the finalizing process has to enqueue the export itself
EXPORTING_STATUSES = frozenset({JobStatus.FINALIZING, JobStatus.CANCELLING, JobStatus.EXPIRED})
FIELDS = (JobField.STATUS, JobField.EXPIRES_AT, JobField.EXPORT_REQUESTED_AT, JobField.EXPORTED_AT,
          JobField.SUBMITTED, JobField.TOTAL, JobField.CANCELLING_AT)
ABANDONED_MS = 60_000  # a job cancelled this long ago while still validating gets total = submitted


class Accounting:
    """The periodic job sweep."""

    def __init__(self, r: redis.Redis, keys: Keys, settings: Settings, jobs: JobCache, sink: RowSink,
                 chunk: int = 500, export_grace_ms: int = EXPORT_GRACE_MS, clock: WallClock = WALL_MS):
        self.redis, self.keys, self.settings, self.jobs, self.sink = r, keys, settings, jobs, sink
        self.clock = clock  # expiry and the export safety net are decided by it
        self.store = JobStore(r, keys)
        self.chunk, self.export_grace_ms = chunk, export_grace_ms
        self.cursor = 0

    def step(self) -> int:
        """Sweep the next chunk of this partition's jobs; returns how many were acted on."""
        if self.keys.partition == 0:  # a registry's upkeep: one partition's owner does it
            self.redis.zremrangebyscore(self.keys.cancelled_requests, "-inf",
                                        f"({self.clock() - CANCEL_KEEP_SECONDS * 1000}")
        raw = replies.members(self.redis.zrange(self.keys.jobs, self.cursor, self.cursor + self.chunk - 1))
        ids = [j.decode() for j in raw]
        self.cursor = 0 if len(ids) < self.chunk else self.cursor + self.chunk
        if not ids:
            return 0
        pipe = self.redis.pipeline(transaction=False)
        for job_id in ids:
            pipe.hmget(self.keys.job(job_id), *FIELDS)
        now, acted = self.clock(), 0
        for job_id, values in zip(ids, pipe.execute(), strict=True):
            fields = parse_fields(FIELDS, values)  # in FIELDS' order
            status, expires, requested, exported, submitted, total, cancelling_at = fields.values()
            submitted = submitted or 0
            if status in (JobStatus.VALIDATING, JobStatus.IN_PROGRESS) and expires and now > expires:
                self._expire(job_id, validating=status is JobStatus.VALIDATING, submitted=submitted)
                acted += 1
            elif (status is JobStatus.CANCELLING and total is None and cancelling_at
                  and now - cancelling_at > ABANDONED_MS):
                log.info("job %s: cancelled during submission; closing it at %s requests", job_id, submitted)
                self._close(job_id, submitted)
                acted += 1
            elif (status in EXPORTING_STATUSES and requested and not exported
                  and now - requested > self.export_grace_ms and not self._export_queued(job_id)):
                log.warning("job %s: all rows in but no export job found; enqueueing it", job_id)
                self.sink.enqueue_export(job_id)
                acted += 1
        return acted

    def _expire(self, job_id: str, validating: bool, submitted: int) -> None:
        expect = [JobStatus.VALIDATING, JobStatus.IN_PROGRESS]
        if not self.store.set_status(job_id, JobStatus.EXPIRED, expect=expect):
            return  # it moved on meanwhile
        self.redis.sadd(self.keys.for_job(job_id).cancelled, job_id)
        self.jobs.forget(job_id)
        log.info("job %s expired (completion window over)", job_id)
        if validating:
            self._close(job_id, submitted)

    def _close(self, job_id: str, submitted: int) -> None:
        """End a submission nobody will end: total = what was submitted."""
        self.sink.finish_submission(job_id, submitted)

    def _export_queued(self, job_id: str) -> bool:
        from rq.job import Job

        from batchinfer.jobs.queueing import rq_job_id

        return Job.exists(rq_job_id("export", self.settings.prefix, job_id),
                          connection=self.settings.connect_rq(self.redis))


# -- settling what cancelled and expired jobs left where no live worker holds it (Settler) -------

BATCH_SCAN = 256  # batch entries looked at per model per step (a cursor goes round the stream)
HELD_CHUNK, HELD_SCAN = 1000, 5000  # holding area entries read per XRANGE, and per step
SETTLE_FIELDS = (JobField.STATUS, JobField.EXPORT_REQUESTED_AT, JobField.HELD)
# a job's status -> the status of the rows its unanswered requests get
ENDED = {JobStatus.CANCELLING: "cancelled", JobStatus.EXPIRED: "expired"}


# -- the policy (pure) --------------------------------------------------------------------------

@dataclass(frozen=True)
class JobState:
    """What the settler reads of a job in ``{p}:cancelled``."""

    status: JobStatus | None
    export_requested: bool  # every request has its row already
    held: int = 0  # requests in the holding area now


def ended_jobs(states: Mapping[str, JobState]) -> dict[str, str]:
    """Jobs that ended (cancelling, expired) with requests still unanswered -> their rows' status."""
    return {job: ENDED[s.status] for job, s in states.items()
            if s.status in ENDED and not s.export_requested}


@dataclass(frozen=True)
class BatchView:
    """One entry of a batch stream as the settler sees it.

    ``owner``: the consumer of the ``workers`` group it is pending for; None for an entry no consumer
    has read yet. ``whole``: every element decoded (an entry with malformed elements is never removed
    here: the worker or the lease dead-letters those).
    """

    entry_id: str
    requests: tuple[BatchRequest, ...]
    owner: str | None = None
    whole: bool = True


@dataclass(frozen=True)
class Settlement:
    """What to do with one batch entry: publish ``rows`` (request, row status), then, when
    ``remove``, drop the entry if it is still unclaimed (pending for ``owner`` when it has one)."""

    entry_id: str
    owner: str | None
    rows: tuple[tuple[BatchRequest, str], ...]
    remove: bool


def plan_batches(batches: Iterable[BatchView], live: Collection[str],
                 ended: Mapping[str, str]) -> list[Settlement]:
    """The settlements of ``batches``: for each entry no live worker holds (``live``: worker names,
    which are their consumer names), rows for the requests of ``ended`` jobs; the entry is removed
    when those are all of it."""
    out = []
    for batch in batches:
        if batch.owner is not None and batch.owner in live:
            continue  # a live worker holds it: it aborts these requests itself, or its lease ends
        rows = tuple((q, status) for q in batch.requests
                     if q.job_id is not None and (status := ended.get(q.job_id)) is not None)
        if rows:
            out.append(Settlement(batch.entry_id, batch.owner, rows,
                                  remove=batch.whole and len(rows) == len(batch.requests)))
    return out


def held_of(entries: Iterable[replies.Entry], jobs: Collection[str]) -> list[replies.Entry]:
    """The holding area entries of ``jobs``."""
    wanted = {job.encode() for job in jobs}
    return [(eid, fields) for eid, fields in entries if fields.get(b"job") in wanted]


def stream_id(entry_id: str) -> tuple[int, int]:
    """A stream id ``ms-seq`` as a pair that sorts as Redis orders ids."""
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


# -- the Redis edge -------------------------------------------------------------------------------

class Settler:
    """Answers the requests of cancelled and expired jobs that no live worker holds, at once.

    A cancel (or a window's end) must not wait for a worker to read what is left of its job: with
    no worker for the model the job would stay ``cancelling`` for good. Where a request can be:

    - **staged**: dispatch answers those every pass, worker or not (``Dispatcher._drop_ended``);
    - **held** (model not served): the job's entries in ``{p}:held`` (its ``held`` counter says
      whether it has any) are re-decided now through the intake's own path
      (``Intake.redecide_held``), not when the 2-s, 500-entry sweep reaches them;
    - **in a batch** on ``{p}:batches:<model>``: an entry no consumer of the ``workers`` group has
      read (after its ``last-delivered-id``), or one pending for a consumer that is no live worker,
      gets the rows of its ended jobs' requests now; one a live worker holds is left to that
      worker (it aborts them, docs/worker.md) or to its lease.

    Rows go first, through :class:`~batchinfer.scheduler.lookups.RowSink` (the exactly-once guard,
    the counters, the export once a job's last row is in); then an entry whose every request is
    answered is removed by ``drop_unclaimed_batch.lua`` only if it is still unclaimed (or still
    pending for the same gone consumer). A worker that reads it in between finds the rows
    published and skips them, and a row it writes anyway is dropped by the guard: never two rows,
    counters exact. An entry that mixes ended and running jobs keeps its place; its ended requests
    are answered, and skipped when it runs. The policy is pure (:func:`ended_jobs`,
    :func:`plan_batches`, :func:`held_of`); this class is the Redis edge, run every second with the
    accounting sweep.
    """

    def __init__(self, r: redis.Redis, keys: Keys, registry: Registry, jobs: JobCache, sink: RowSink,
                 intake: Intake):
        self.redis, self.keys, self.registry, self.jobs, self.sink = r, keys, registry, jobs, sink
        self.intake = intake
        self._drop = scripts.register(r, "drop_unclaimed_batch")
        self.batch_cursor: dict[str, str] = {}
        self.held_cursor = "-"

    def step(self) -> int:
        """Settle what no worker holds of every ended job; returns rows published + entries removed."""
        states = self._states()
        ended = ended_jobs(states)
        if not ended:
            return 0
        live = {w.name for w in self.registry.live_workers()}
        done = sum(self.settle_batches(model, ended, live) for model in self.registry.models())
        held = [job for job in ended if states[job].held > 0]
        if held:
            done += self.settle_held(held)
        return done

    def _states(self) -> dict[str, JobState]:
        """The jobs of ``{p}:cancelled`` (cancelled or expired, not yet exported)."""
        jobs = sorted(as_text(j) for j in replies.members(self.redis.smembers(self.keys.cancelled)))
        if not jobs:
            return {}
        pipe = self.redis.pipeline(transaction=False)
        for job in jobs:
            pipe.hmget(self.keys.job(job), *SETTLE_FIELDS)
        out = {}
        for job, values in zip(jobs, pipe.execute(), strict=True):
            try:
                status, requested, held = parse_fields(SETTLE_FIELDS, values).values()
            except ValueError:  # a record another producer garbled: never stop the loop for it
                continue
            out[job] = JobState(status, requested is not None, max(0, held or 0))
        return out

    def settle_batches(self, model: str, ended: Mapping[str, str], live: Collection[str]) -> int:
        """Settle the next :data:`BATCH_SCAN` entries of ``model``'s batch stream."""
        stream = self.keys.batches(model)
        start = self.batch_cursor.get(model, "-")
        entries = replies.entries(self.redis.xrange(stream, min=start, count=BATCH_SCAN))
        self.batch_cursor[model] = "-" if len(entries) < BATCH_SCAN else "(" + as_text(entries[-1][0])
        if not entries:
            return 0
        views = self._views(stream, entries)
        done = 0
        for plan in plan_batches(views, live, ended):
            done += self._publish(plan.rows)
            if plan.remove:
                done += int(self._drop(keys=[stream], args=[WORKERS_GROUP, plan.entry_id, plan.owner or ""]))
        return done

    def _views(self, stream: str, entries: Sequence[replies.Entry]) -> list[BatchView]:
        """The entries with their owners; entries delivered and acknowledged (being deleted by their
        worker) and entries that are no batch (dead-lettered by whoever reads them) are left out."""
        first, last = as_text(entries[0][0]), as_text(entries[-1][0])
        try:
            pending = self.redis.xpending_range(stream, WORKERS_GROUP, min=first, max=last,
                                                count=len(entries))
            delivered = self._last_delivered(stream)
        except redis.ResponseError as e:
            if "NOGROUP" not in str(e):
                raise
            pending, delivered = [], (0, 0)  # no worker ever read this stream
        owners = {as_text(p["message_id"]): as_text(p["consumer"]) for p in pending}
        out = []
        for raw_id, fields in entries:
            entry_id = as_text(raw_id)
            owner = owners.get(entry_id)
            if owner is None and stream_id(entry_id) <= delivered:
                continue
            try:
                batch = decode(fields)
            except MalformedBatch:
                continue
            out.append(BatchView(entry_id, tuple(batch.requests), owner, whole=not batch.rejected))
        return out

    def _last_delivered(self, stream: str) -> tuple[int, int]:
        for group in self.redis.xinfo_groups(stream):
            info = {as_text(k): v for k, v in group.items()}
            if as_text(info.get("name")) == WORKERS_GROUP:
                return stream_id(as_text(info.get("last-delivered-id")) or "0-0")
        return 0, 0

    def _publish(self, rows: Sequence[tuple[BatchRequest, str]]) -> int:
        """Publish the rows not published yet (a batch left in place is seen again next step)."""
        published = self.sink.publisher.published_mask([(q.job_id, q.idx, q.request_id) for q, _ in rows])
        count: Counter[tuple[str | None, str]] = Counter()
        for (q, ended), done in zip(rows, published, strict=True):
            if done:
                continue
            row = ResultRow.error(ended, f"the job was {ended} before this request ran", status=ended,
                                  request=q)
            if self.sink.publish(row, q.reply_to):
                count[(q.job_id, ended)] += 1
        for (job, ended), n in count.items():
            log.info("job %s: %d request(s) in batches no worker holds %s", job, n, ended)
        return sum(count.values())

    def settle_held(self, jobs: Collection[str]) -> int:
        """Re-decide the held entries of ``jobs`` among the next :data:`HELD_SCAN` of the holding area."""
        found: list[replies.Entry] = []
        for _ in range(HELD_SCAN // HELD_CHUNK):
            entries = replies.entries(self.redis.xrange(self.keys.held, min=self.held_cursor,
                                                        count=HELD_CHUNK))
            self.held_cursor = "-" if len(entries) < HELD_CHUNK else "(" + as_text(entries[-1][0])
            found += held_of(entries, jobs)
            if len(entries) < HELD_CHUNK:
                break
        if not found:
            return 0
        for job in jobs:
            self.jobs.forget(job)  # the intake decides on the job's state as it is now
        return self.intake.redecide_held(found)
