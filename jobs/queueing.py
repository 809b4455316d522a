"""Putting exports on the rq queue: what the daemons need, without the exporter's pyarrow.

The scheduler, the workers and the client enqueue a job's export when its last row lands
(:func:`publish_then_export`, :func:`finish_then_export`); importing :mod:`batchinfer.jobs.export`
for that would load pyarrow (about 40 MB resident) into every daemon.
"""

from __future__ import annotations

import contextlib
import hashlib
import re
from typing import TYPE_CHECKING

import redis

from batchinfer.config import Settings
from batchinfer.keys import RQ_QUEUE
from batchinfer.store.publish import ReplicasBehind, RowsFailed

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from batchinfer.store.publish import Publisher, PublishOutcome, Row

RETRY_INTERVALS = (10, 30, 60)  # seconds before each rq retry
EXPORT_TIMEOUT_S = 6 * 3600


def rq_job_id(kind: str, prefix: str, name: str) -> str:
    """A deterministic rq job id for ``name`` under ``prefix`` (rq allows letters, digits, ``_``, ``-``)."""
    digest = hashlib.sha1(f"{prefix}\0{name}".encode()).hexdigest()[:12]
    return f"batchinfer-{kind}-{re.sub(r'[^A-Za-z0-9_-]', '_', name)[:80]}-{digest}"


def enqueue_export(r: redis.Redis, settings: Settings, job_id: str, *, output: str | None = None,
                   fmt: str | None = None) -> str:
    """Enqueue ``export_job`` for ``job_id`` on the rq queue (JSON serializer, retries); returns its rq id.

    At most one export per job: the rq job id is derived from the prefix and job id, and the
    enqueue is rq's atomic ``unique`` one, so while that rq job exists (queued, started, booked
    for a retry, finished or failed) a later call adds nothing (its ``output`` / ``fmt`` are
    ignored) and returns the same id. Once rq has dropped it (result / failure TTL), a call
    enqueues a new one: the scheduler's export safety net relies on that. A job deleted and
    submitted again under its id must have its old export forgotten first (:func:`forget_export`).
    """
    from rq import Queue, Retry
    from rq.exceptions import DuplicateJobError
    from rq.serializers import JSONSerializer

    rq_id = rq_job_id("export", settings.prefix, job_id)
    rq = settings.connect_rq(r)  # rq's Redis: the data Redis unless BATCHINFER_RQ_REDIS_URL
    queue = Queue(RQ_QUEUE, connection=rq, serializer=JSONSerializer)
    # A DuplicateJobError means this job's export exists already: a retried call, or the safety net's race.
    with contextlib.suppress(DuplicateJobError):
        queue.enqueue_call(
            "batchinfer.jobs.export.export_job", args=[job_id],
            kwargs={"prefix": settings.prefix, "output": output, "fmt": fmt},
            job_id=rq_id, description=f"export {job_id}", unique=True,
            retry=Retry(max=len(RETRY_INTERVALS), interval=list(RETRY_INTERVALS)),
            timeout=EXPORT_TIMEOUT_S, result_ttl=settings.results_ttl_seconds,
            failure_ttl=settings.results_ttl_seconds,
        )
    return rq_id


def forget_export(r: redis.Redis, prefix: str, job_id: str) -> bool:
    """Forget job ``job_id``'s export rq job (its hash, result and registry entries, through rq's
    ``Job.delete``), for a job record deleted to be submitted again under the same id: otherwise
    the old export, finished or failed and kept for the results TTL, passes for the new job's
    (:func:`enqueue_export` adds nothing, the scheduler's safety net finds it) and the new job
    never leaves ``finalizing``.

    True when no export rq job is left; False while it runs (``started``: the exporter would save
    it again when it ends), and the caller should look again later.
    """
    from rq.exceptions import NoSuchJobError
    from rq.job import Job, JobStatus
    from rq.serializers import JSONSerializer

    try:
        job = Job.fetch(rq_job_id("export", prefix, job_id), connection=r, serializer=JSONSerializer)
    except NoSuchJobError:
        return True
    if job.get_status() == JobStatus.STARTED:
        return False
    job.delete()
    return True


def publish_then_export(publisher: Publisher, rows: Sequence[tuple[Row, str | None]],
                        export: Callable[[str], object]) -> list[PublishOutcome]:
    """Publish ``(row, reply_to)`` pairs (``Publisher.publish_many``: one round trip) and call
    ``export(job_id)`` for every job one of them made final; the outcomes in the rows' order.

    Exactly one publication ever sees a job's ``finalizing``, so its export is this caller's to
    enqueue (else only the scheduler's safety net, 30 s later, does). ``export`` is the caller's
    :func:`enqueue_export` on its connection and settings, or a list's ``append`` to enqueue later.
    """
    try:
        outcomes = publisher.publish_many(rows)
    except (ReplicasBehind, RowsFailed) as partly:  # what was published: its exports are due all the same
        _export_final(rows, partly.outcomes, export)
        raise
    _export_final(rows, outcomes, export)
    return outcomes


def _export_final(rows: Sequence[tuple[Row, str | None]], outcomes: Sequence[PublishOutcome | None],
                  export: Callable[[str], object]) -> None:
    for (row, _), outcome in zip(rows, outcomes, strict=True):
        if outcome is not None and outcome.finalizing and row.job_id:
            export(row.job_id)


def finish_then_export(publisher: Publisher, job_id: str, total: int,
                       export: Callable[[str], object]) -> bool:
    """``Publisher.finish_submission(job_id, total)``, then ``export(job_id)`` when that made the job
    final (its rows were all in already); returns whether it did."""
    final = publisher.finish_submission(job_id, total)
    if final:
        export(job_id)
    return final
