"""Putting exports on the rq queue: what the daemons need, without the exporter's pyarrow.

The scheduler and the workers enqueue a job's export when its last row lands; importing
:mod:`batchinfer.jobs.export` for that would load pyarrow (about 40 MB resident) into every daemon.
"""

from __future__ import annotations

import contextlib
import hashlib
import re

import redis

from batchinfer.config import Settings
from batchinfer.keys import RQ_QUEUE

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
    enqueues a new one: the scheduler's export safety net relies on that.
    """
    from rq import Queue, Retry
    from rq.exceptions import DuplicateJobError
    from rq.serializers import JSONSerializer

    rq_id = rq_job_id("export", settings.prefix, job_id)
    queue = Queue(RQ_QUEUE, connection=r, serializer=JSONSerializer)
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
