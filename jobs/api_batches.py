"""Putting the start of an HTTP API batch on the rq queue (the exporter runs it).

``POST /v1/batches`` records the batch (``validating``) and calls :func:`enqueue_start`; the job,
:func:`batchinfer.api.batch_start.start_batch`, validates the input file and submits it as the
batch's job. It is named here by its path, not imported: it submits through the client, which is
above this package (the client enqueues exports), so an import would close a package circle.
"""

from __future__ import annotations

import contextlib

import redis

from batchinfer.config import Settings
from batchinfer.jobs.queueing import RETRY_INTERVALS, rq_job_id
from batchinfer.keys import RQ_QUEUE

START_JOB = "batchinfer.api.batch_start.start_batch"
START_TIMEOUT_S = 3600  # validating and submitting 50,000 lines takes seconds; a 200 MB file longer


def enqueue_start(r: redis.Redis, settings: Settings, batch_id: str) -> str:
    """Enqueue :data:`START_JOB` for ``batch_id`` (rq's unique enqueue: at most one per batch,
    retried like exports); returns its rq job id."""
    from rq import Queue, Retry
    from rq.exceptions import DuplicateJobError
    from rq.serializers import JSONSerializer

    rq_id = rq_job_id("start", settings.prefix, batch_id)
    rq = settings.connect_rq(r)  # rq's Redis: the data Redis unless BATCHINFER_RQ_REDIS_URL
    queue = Queue(RQ_QUEUE, connection=rq, serializer=JSONSerializer)
    with contextlib.suppress(DuplicateJobError):  # enqueued already: a retried create
        queue.enqueue_call(
            START_JOB, args=[batch_id], kwargs={"prefix": settings.prefix},
            job_id=rq_id, description=f"start batch {batch_id}", unique=True,
            retry=Retry(max=len(RETRY_INTERVALS), interval=list(RETRY_INTERVALS)),
            timeout=START_TIMEOUT_S, result_ttl=settings.results_ttl_seconds,
            failure_ttl=settings.results_ttl_seconds)
    return rq_id
