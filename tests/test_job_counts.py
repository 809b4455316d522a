"""Job status and counts: cancelled and expired rows are counted apart from failed ones, and a job
whose completion window ended before its last row ends ``expired`` (partial results exported), end
to end with the scheduler, an echo worker daemon and the export, on a real redis-server."""

from __future__ import annotations

import json
import threading
import time

import pyarrow.parquet as pq
import pytest
from daemons import wait_until, worker_daemon

from batchinfer.cli.render import record_text
from batchinfer.config import Settings
from batchinfer.jobs.export import export_job
from batchinfer.keys import Keys
from batchinfer.protocol.entries import IntakeEntry
from batchinfer.protocol.rows import ResultRow
from batchinfer.scheduler.daemon import SchedulerDaemon
from batchinfer.store.jobstore import JobRecord, JobStatus, JobStore
from batchinfer.store.publish import Publisher
from batchinfer.workers.service.echo_engine import EchoEngine

PREFIX = "{jc}"
KEYS = Keys(PREFIX)




def _row(job: str, idx: int, status: str) -> ResultRow:
    if status == "completed":
        return ResultRow(job_id=job, idx=idx, request_id=f"{job}:{idx}", status=status, output_text="x")
    return ResultRow.error(status, "no", status=status, job_id=job, idx=idx)


def test_each_row_status_has_its_counter_and_all_four_finalize(redis_server):
    r = redis_server.client()
    store, pub = JobStore(r, KEYS), Publisher(r, KEYS)
    store.create("j", model="m")
    statuses = ["completed", "failed", "cancelled", "cancelled", "expired"]
    for i, status in enumerate(statuses[:-1]):
        pub.publish(_row("j", i, status))
    assert not pub.finish_submission("j", len(statuses))  # one row still missing
    assert pub.publish(_row("j", 4, "expired")).finalizing  # the fifth row, of any status, ends it
    record = store.get("j")
    assert (record.completed, record.failed, record.cancelled, record.expired) == (1, 1, 2, 1)
    assert record.done == 5 and record.status is JobStatus.FINALIZING
    assert record.request_counts == {"total": 5, "completed": 1, "failed": 1, "cancelled": 2, "expired": 1,
                                     "held": 0}
    assert "1 completed, 1 failed, 2 cancelled, 1 expired" in record_text(record)


def test_a_record_written_before_the_split_still_reads_and_finalizes(redis_server):
    r = redis_server.client()
    # an old record: cancelled rows were counted in `failed`, and there is no cancelled field
    r.hset(KEYS.job("old"), mapping={"id": "old", "status": "in_progress", "total": 3, "completed": 1,
                                     "failed": 1, "expires_at": int(time.time() * 1000) + 60_000})
    record = JobStore(r, KEYS).get("old")
    assert (record.cancelled, record.expired, record.done) == (0, 0, 2)
    assert Publisher(r, KEYS).publish(_row("old", 2, "cancelled")).finalizing
    assert JobRecord.from_hash(r.hgetall(KEYS.job("old"))).status is JobStatus.FINALIZING


def test_the_last_row_after_the_window_makes_the_job_expired_and_the_export_keeps_it(redis_server, tmp_path):
    r = redis_server.client()
    store, pub = JobStore(r, KEYS), Publisher(r, KEYS)
    store.create("late", model="m", completion_window=1)
    pub.finish_submission("late", 2)
    pub.publish(_row("late", 0, "completed"))
    r.hset(KEYS.job("late"), "expires_at", 1)  # the window is over; the sweep has not run yet
    assert pub.publish(_row("late", 1, "failed")).finalizing
    record = store.get("late")
    assert record.status is JobStatus.EXPIRED and record.expired_at and not record.finalizing_at
    out = tmp_path / "late.parquet"
    export_job("late", prefix=PREFIX, output=str(out), redis_url=redis_server.url)
    record = store.get("late")
    assert record.status is JobStatus.EXPIRED and record.output == str(out) and record.exported_at
    assert pq.read_table(out).num_rows == 2


class Daemons:
    """The scheduler looping in a thread and, optionally, an echo worker daemon."""

    def __init__(self, r, worker: EchoEngine | None):
        self.r, self.stop = r, threading.Event()
        settings = Settings(prefix=PREFIX, heartbeat_seconds=0.3, lease_seconds=30)
        self.sched = SchedulerDaemon(r, settings, block_ms=20)
        self.sched.dispatcher.jobs.ttl = self.sched.admission.jobs.ttl = 0
        self.sched.timers["held"].period = 0.2  # a held request's deadline is checked often
        self.threads = [threading.Thread(target=self._schedule, daemon=True)]
        if worker is not None:
            daemon = worker_daemon(r, settings, worker, "w1", cancel_poll_seconds=0.1)
            self.threads.append(threading.Thread(target=daemon.run, args=(self.stop,), daemon=True))
        for t in self.threads:
            t.start()

    def _schedule(self):
        while not self.stop.is_set():
            self.sched.run_once()

    def close(self):
        self.stop.set()
        for t in self.threads:
            t.join(timeout=30)


@pytest.fixture
def daemons(redis_server):
    started: list[Daemons] = []

    def start(worker: EchoEngine | None = None) -> Daemons:
        started.append(Daemons(redis_server.client(), worker))
        return started[-1]

    yield start
    for d in started:
        d.close()


def _submit(r, job: str, n: int, model: str = "echo", window: int = 3600) -> None:
    JobStore(r, KEYS).create(job, model=model, completion_window=window)
    for i in range(n):
        body = json.dumps({"custom_id": f"c{i}", "prompt": f"p{i}", "max_tokens": 4})
        r.xadd(KEYS.requests, IntakeEntry(body=body, job_id=job, idx=i, line=i + 1).to_fields())
    Publisher(r, KEYS).finish_submission(job, n)


def _wait_done(r, job: str) -> JobRecord:
    def done():
        rec = JobStore(r, KEYS).get(job)
        return rec if rec and rec.total is not None and rec.done >= rec.total else None
    return wait_until(done, what=f"every row of {job}")


def test_a_slow_job_past_its_window_ends_expired_with_its_partial_results(daemons, redis_server, tmp_path):
    r = redis_server.client()
    d = daemons(EchoEngine(requests_per_step=1, max_num_seqs=1, step_delay=0.1))
    wait_until(lambda: r.exists(KEYS.model("echo")), what="the worker's registration")
    _submit(r, "slow", 40, window=2)  # 40 requests x 4 steps x 0.1 s: far more than 2 s
    record = _wait_done(r, "slow")
    assert record.status is JobStatus.EXPIRED
    assert record.completed > 0 and record.expired > 0 and record.failed == 0 and record.cancelled == 0
    assert record.completed + record.expired == 40
    d.close()
    out = tmp_path / "slow.parquet"
    export_job("slow", prefix=PREFIX, output=str(out), redis_url=redis_server.url)
    assert JobStore(r, KEYS).get("slow").status is JobStatus.EXPIRED  # expired stays expired
    statuses = pq.read_table(out).column("status").to_pylist()
    assert len(statuses) == 40 and set(statuses) == {"completed", "expired"}


def test_a_job_for_a_model_nobody_serves_ends_expired_not_completed(daemons, redis_server):
    r = redis_server.client()
    daemons()  # a scheduler, no worker at all
    _submit(r, "nobody", 3, model="gpt-4o-mini", window=1)
    record = _wait_done(r, "nobody")
    assert record.status is JobStatus.EXPIRED
    assert record.done == 3 and record.completed == 0


def test_a_cancelled_job_counts_its_cancelled_rows_apart(daemons, redis_server, tmp_path):
    r = redis_server.client()
    d = daemons(EchoEngine(requests_per_step=1, max_num_seqs=1, step_delay=0.1))
    wait_until(lambda: r.exists(KEYS.model("echo")), what="the worker's registration")
    _submit(r, "cx", 40)
    wait_until(lambda: (rec := JobStore(r, KEYS).get("cx")) and rec.completed >= 1,
               what="a first completed row")
    JobStore(r, KEYS).cancel("cx")
    record = _wait_done(r, "cx")
    d.close()
    assert record.cancelled > 0 and record.failed == 0 and record.completed + record.cancelled == 40
    export_job("cx", prefix=PREFIX, output=str(tmp_path / "cx.parquet"), redis_url=redis_server.url)
    record = JobStore(r, KEYS).get("cx")
    assert record.status is JobStatus.CANCELLED
    assert f"{record.cancelled} cancelled" in record_text(record) and "0 failed" in record_text(record)
