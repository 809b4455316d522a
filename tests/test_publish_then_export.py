"""``publish_then_export`` / ``finish_then_export``: the call that made a job final enqueues its export,
once, and no other call does (a real redis-server, the real rq enqueue)."""

from __future__ import annotations

import pytest
from rq import Queue
from rq.serializers import JSONSerializer

from batchinfer.config import Settings
from batchinfer.jobs.queueing import enqueue_export, finish_then_export, publish_then_export, rq_job_id
from batchinfer.keys import RQ_QUEUE, Keys
from batchinfer.protocol.rows import ResultRow
from batchinfer.store.publish import Publisher

PREFIX = "{t}"
KEYS = Keys(PREFIX)


@pytest.fixture
def r(redis_server):
    return redis_server.client()


@pytest.fixture
def export(r):
    """The real enqueue, recording the job ids it was asked for."""
    settings, asked = Settings(prefix=PREFIX), []

    def enqueue(job_id: str) -> None:
        asked.append(job_id)
        enqueue_export(r, settings, job_id)

    enqueue.asked = asked  # type: ignore[attr-defined]
    return enqueue


def make_job(r, job_id: str, status: str, total: int | None = None) -> None:
    r.hset(KEYS.job(job_id), mapping={"id": job_id, "status": status, "completed": 0, "failed": 0})
    if total is not None:
        r.hset(KEYS.job(job_id), "total", total)


def row(job_id: str | None, idx: int | None, request_id: str | None = None) -> ResultRow:
    return ResultRow(job_id=job_id, idx=idx, request_id=request_id or f"{job_id}:{idx}", status="completed",
                     output_text="hi")


def queued(r) -> list[str]:
    return Queue(RQ_QUEUE, connection=r, serializer=JSONSerializer).get_job_ids()


def test_only_the_publication_that_makes_the_job_final_enqueues_its_export(r, export):
    make_job(r, "a", "in_progress", total=3)
    make_job(r, "b", "in_progress", total=5)
    pub = Publisher(r, KEYS)
    rows = [(row("a", 0), None), (row("b", 0), None), (row(None, None, "d1"), None)]  # d1: a direct row
    first = publish_then_export(pub, rows, export)
    assert [o.published for o in first] == [True, True, True] and not any(o.finalizing for o in first)
    assert export.asked == [] and queued(r) == []
    # a repeat of a published row in the same call: published once, and the job is final at idx 2
    last = publish_then_export(pub, [(row("a", 1), None), (row("a", 1), None), (row("a", 2), None)], export)
    assert [(o.published, o.finalizing) for o in last] == [(True, False), (False, False), (True, True)]
    assert export.asked == ["a"] and queued(r) == [rq_job_id("export", PREFIX, "a")]
    # the same rows again (a worker's re-run): nothing is published, nothing enqueued again
    again = publish_then_export(pub, [(row("a", 2), None), (row("a", 0), None)], export)
    assert not any(o.published or o.finalizing for o in again)
    assert export.asked == ["a"] and queued(r) == [rq_job_id("export", PREFIX, "a")]
    assert publish_then_export(pub, [], export) == []


def test_a_later_export_can_be_deferred(r):
    make_job(r, "c", "in_progress", total=1)
    later: list[str] = []  # the worker's outbox enqueues after its dead letters
    [outcome] = publish_then_export(Publisher(r, KEYS), [(row("c", 0), None)], later.append)
    assert outcome.finalizing and later == ["c"] and queued(r) == []


def test_finish_exports_only_a_job_whose_rows_are_all_in(r, export):
    make_job(r, "open", "validating")
    make_job(r, "done", "validating")
    pub = Publisher(r, KEYS)
    publish_then_export(pub, [(row("open", 0), None), (row("done", 0), None), (row("done", 1), None)], export)
    assert not finish_then_export(pub, "open", 2, export)  # one row still owed
    assert finish_then_export(pub, "done", 2, export)  # every row already in: this call finalizes
    assert not finish_then_export(pub, "done", 2, export)  # only once
    assert export.asked == ["done"] and queued(r) == [rq_job_id("export", PREFIX, "done")]
    [outcome] = publish_then_export(pub, [(row("open", 1), None)], export)  # the last row of "open"
    assert outcome.finalizing and export.asked == ["done", "open"]
    assert r.hget(KEYS.job("open"), "status") == b"finalizing"
