"""Job accounting sweep: expiry by completion window, and the export safety net.

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
"""

from __future__ import annotations

import logging

import redis

from batchinfer.clock import WALL_MS, WallClock
from batchinfer.config import Settings
from batchinfer.keys import Keys
from batchinfer.scheduler.lookups import JobCache, RowSink
from batchinfer.store import replies
from batchinfer.store.jobstore import JobField, JobStatus, JobStore, parse_fields

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
        """Sweep the next chunk of jobs; returns how many were acted on."""
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
        self.redis.sadd(self.keys.cancelled, job_id)
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

        return Job.exists(rq_job_id("export", self.settings.prefix, job_id), connection=self.redis)
