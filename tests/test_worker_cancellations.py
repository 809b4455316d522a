"""The worker's view of cancelled jobs (workers/service/feeder.py): why their rows end, and the
snapshot the publisher thread polls and the engine thread takes once per poll."""

from __future__ import annotations

from batchinfer.keys import Keys
from batchinfer.store.jobstore import JobField, JobStatus
from batchinfer.workers.service.feeder import Cancellations, cancel_reason

KEYS = Keys("{wc}")


def test_an_expired_job_ends_expired_any_other_cancelled():
    assert cancel_reason(JobStatus.EXPIRED)[:2] == ("expired", "expired")
    for status in (JobStatus.CANCELLING, JobStatus.CANCELLED, None):
        assert cancel_reason(status) == ("cancelled", "cancelled", "the job was cancelled")


def test_each_poll_is_taken_once_with_each_jobs_reason(redis_server):
    r = redis_server.client()
    cancels = Cancellations(KEYS)
    assert cancels.take() is None and cancels.jobs == set()  # nothing polled yet
    r.sadd(KEYS.cancelled, "j1", "j2")
    r.hset(KEYS.job("j1"), JobField.STATUS, JobStatus.CANCELLING.value)
    r.hset(KEYS.job("j2"), JobField.STATUS, JobStatus.EXPIRED.value)
    cancels.poll(r)
    reasons = cancels.take()
    assert reasons is not None and cancels.jobs == {"j1", "j2"}
    assert reasons["j1"][0] == "cancelled" and reasons["j2"][0] == "expired"
    assert cancels.take() is None  # the same snapshot: no job ends twice
    assert cancels.reason("j2")[0] == "expired" and cancels.reason("j9")[0] == "cancelled"
    r.srem(KEYS.cancelled, "j1")
    cancels.poll(r)
    assert cancels.take() == {"j2": reasons["j2"]} and cancels.jobs == {"j2"}
