"""Retries with the same client_request_id, reply streams of the wrong type, and results:direct retention:
the scheduler and an echo worker daemon against a real redis-server."""

from __future__ import annotations

import json
import logging
import threading

import pytest
from clocks import FakeClock
from daemons import wait_until, worker_daemon

from batchinfer.config import Settings
from batchinfer.keys import WORKERS_GROUP, Keys
from batchinfer.ops.metrics import SchedulerMetrics
from batchinfer.protocol.entries import IntakeEntry
from batchinfer.protocol.rows import ResultRow, now_ms
from batchinfer.scheduler.daemon import SchedulerDaemon
from batchinfer.store.jobstore import JobStore
from batchinfer.store.publish import Publisher
from batchinfer.store.registry import Registry
from batchinfer.workers.service.daemon import WorkerDaemon
from batchinfer.workers.service.echo_engine import EchoEngine

PREFIX = "{rd}"
KEYS = Keys(PREFIX)
BODY = json.dumps({"custom_id": "q1", "model": "echo", "prompt": "Hello", "max_tokens": 4})


def _settings() -> Settings:
    return Settings(prefix=PREFIX, heartbeat_seconds=0.3)




def _rows(r, stream: str) -> list[ResultRow]:
    return [ResultRow.from_json(f[b"row"]) for _, f in r.xrange(stream)]


class Stack:
    """A scheduler (passes run by the test) and, once started, an echo worker daemon in a thread."""

    def __init__(self, r):
        self.r = r
        self.engine = EchoEngine(requests_per_step=4, max_num_seqs=8)
        # the model is registered and "served" before the worker runs, so requests wait in its batch
        # stream until the test starts the worker
        registry = Registry(r, KEYS)
        registry.register_model("echo", self.engine.tokenizer_files(), self.engine.capacity())
        registry.heartbeat_worker("w0", {"model": "echo", "capacity": self.engine.capacity()}, ttl=60)
        self.metrics = SchedulerMetrics()
        self.sched = SchedulerDaemon(r, _settings(), metrics=self.metrics)
        self.sched.dispatcher.jobs.ttl = self.sched.admission.jobs.ttl = 0
        self.worker: WorkerDaemon | None = None
        self.stop_event = threading.Event()
        self.thread: threading.Thread | None = None

    def send(self, reply_to: str | None, crid: str | None = "my-service-42", body: str = BODY) -> str:
        entry = IntakeEntry(body=body, reply_to=reply_to, client_request_id=crid)
        return self.r.xadd(KEYS.requests, entry.to_fields()).decode()

    def schedule(self, passes: int = 20) -> None:
        for _ in range(passes):
            if self.sched.run_once(block_ms=10) == 0:
                return

    def start_worker(self) -> WorkerDaemon:
        self.worker = worker_daemon(self.r, _settings(), self.engine, "w1")
        self.thread = threading.Thread(target=self.worker.run, args=(self.stop_event,), daemon=True)
        self.thread.start()
        return self.worker

    def stop(self) -> None:
        self.stop_event.set()
        if self.thread is not None:
            self.thread.join(timeout=30)
            assert not self.thread.is_alive(), "worker did not drain"


@pytest.fixture
def stack(redis_server):
    s = Stack(redis_server.client())
    yield s
    s.stop()


def test_a_retry_to_a_new_reply_stream_gets_the_original_row_once(stack):
    r = stack.r
    first = stack.send("{rd}:reply:a")
    retry = stack.send("{rd}:reply:b")  # the caller timed out and retried with a fresh reply stream
    stack.schedule()
    assert stack.sched.admission.duplicates == 1
    assert r.xlen("{rd}:reply:b") == 0  # nothing published yet: the retry waits for the row
    stack.start_worker()
    wait_until(lambda: r.xlen("{rd}:reply:a") and r.xlen("{rd}:reply:b"), what="rows on both reply streams")
    (a,), (b,) = _rows(r, "{rd}:reply:a"), _rows(r, "{rd}:reply:b")
    assert a.request_id == b.request_id == first and a.status == "completed"
    assert b.output_text == a.output_text
    assert 0 < r.ttl("{rd}:reply:b") <= 7 * 24 * 3600  # a reply stream nobody reads expires

    # a retry after publication is answered at once, from the kept copy
    stack.send("{rd}:reply:c")
    stack.schedule()
    (c,) = _rows(r, "{rd}:reply:c")
    assert c.request_id == first
    # ... and never twice on one stream: again to b, to the original's own stream, a re-read
    # of the retry's own entry (a scheduler restarted before acking it)
    stack.send("{rd}:reply:b")
    stack.send("{rd}:reply:a")
    stack.schedule()
    fields = IntakeEntry(body=BODY, reply_to="{rd}:reply:b", client_request_id="my-service-42").to_fields()
    assert type(stack.sched.admission.admit(retry, {k.encode(): str(v).encode() for k, v in fields.items()})
                ).__name__ == "Duplicate"
    # the retries were settled by the intake above; the worker has nothing left that could publish
    # a second row (no request held, nothing unsent, no batch unacked)
    worker = stack.worker
    assert worker is not None
    wait_until(lambda: worker.book.empty() and worker.outbox.empty(), what="the worker idle")
    assert r.xpending(KEYS.batches("echo"), WORKERS_GROUP)["pending"] == 0
    assert [r.xlen(f"{{rd}}:reply:{s}") for s in "abc"] == [1, 1, 1]
    # no second row anywhere else: one row in results:direct, one request ever sent to a worker
    assert [x.request_id for x in _rows(r, KEYS.results("direct"))] == [first]
    assert r.xinfo_stream(KEYS.batches("echo"))["entries-added"] == 1
    assert stack.sched.admission.duplicates == 5  # c, b, a, and the re-read of the first retry


def test_a_retry_of_a_rejected_request_gets_its_error_row(stack):
    r = stack.r
    bad = json.dumps({"model": "echo", "prompt": "Hello", "temperature": -1})
    first = stack.send("{rd}:reply:a", crid="bad-1", body=bad)
    stack.schedule()
    stack.send("{rd}:reply:b", crid="bad-1", body=bad)
    stack.send(None, crid="bad-1", body=bad)  # a retry without a reply stream: nothing to deliver
    stack.schedule()
    (a,), (b,) = _rows(r, "{rd}:reply:a"), _rows(r, "{rd}:reply:b")
    assert a.status == b.status == "failed" and b.request_id == first and b.error_code == "invalid_request"
    assert len(_rows(r, KEYS.results("direct"))) == 1


def test_a_reply_to_of_the_wrong_type_is_skipped_counted_and_the_worker_keeps_going(stack, caplog):
    r = stack.r
    r.set("{rd}:reply:str", "not a stream")
    r.hset("{rd}:reply:hash", "x", "1")
    first = stack.send("{rd}:reply:str", crid=None)
    stack.schedule()
    with caplog.at_level(logging.WARNING):
        worker = stack.start_worker()
        wait_until(lambda: r.xlen(KEYS.results("direct")) == 1, what="the row in results:direct")
        # the worker is still serving: a second request (to a good reply stream) is answered
        stack.send("{rd}:reply:ok", crid=None)
        stack.schedule()
        wait_until(lambda: r.xlen("{rd}:reply:ok") == 1, what="the next request's row")
        # a retry to a key of the wrong type (after publication) is not written either
        stack.send("{rd}:reply:a", crid="c2")
        stack.schedule()
        wait_until(lambda: r.xlen("{rd}:reply:a") == 1, what="c2's row")
        stack.send("{rd}:reply:hash", crid="c2")
        stack.schedule()
    assert r.get("{rd}:reply:str") == b"not a stream" and r.hgetall("{rd}:reply:hash") == {b"x": b"1"}
    rows = _rows(r, KEYS.results("direct"))
    assert [x.request_id for x in rows].count(first) == 1 and len(rows) == 3
    warnings = [rec for rec in caplog.records if "not a stream" in rec.getMessage()]
    # one line each, no traceback: the worker's skip of reply:str, the intake's of the retry's reply:hash
    assert len(warnings) == 2 and all(w.exc_info is None for w in warnings)
    assert "{rd}:reply:str" in warnings[0].getMessage() and "{rd}:reply:hash" in warnings[1].getMessage()
    text = worker.metrics.render().decode()
    assert "batchinfer_reply_to_wrong_type_total 1.0" in text
    assert stack.thread is not None and stack.thread.is_alive()  # still serving


def test_a_row_the_scheduler_publishes_to_a_wrong_type_reply_to_is_counted(stack):
    r = stack.r
    r.set("{rd}:reply:str", "x")
    stack.send("{rd}:reply:str", crid=None, body="{not json")
    stack.schedule()
    (row,) = _rows(r, KEYS.results("direct"))
    assert row.error_code == "invalid_json"
    assert "batchinfer_reply_to_wrong_type_total 1.0" in stack.metrics.render().decode()


def test_results_direct_keeps_rows_for_the_retention(redis_server):
    r = redis_server.client()
    r.config_set("stream-node-max-entries", 2)  # MINID ~ trims whole nodes: make them small
    # a fake "now" (rows are still XADDed with Redis's own ids): past the retention without waiting it out
    wall = FakeClock.from_now()
    pub = Publisher(r, KEYS, direct_retention_s=1, clock=wall.ms)

    def direct(i: int) -> ResultRow:
        return ResultRow(job_id=None, request_id=f"0-{i}", status="completed", output_text="x")

    for i in range(10):
        assert pub.publish(direct(i)).published
    JobStore(r, KEYS).create("j", model="echo")  # a job's row needs its record (else it is dropped)
    job = ResultRow(job_id="j", idx=0, request_id="j:0", status="completed")
    assert pub.publish(job).published
    # MINID is now - retention: one retention past the last row's id, the old rows are older than it
    # and row 10 (its id taken after that "now") is not
    last_id = int(r.xinfo_stream(KEYS.results("direct"))["last-generated-id"].split(b"-")[0])
    wait_until(lambda: now_ms() > last_id, what="the next millisecond")
    wall.now = now_ms() / 1000 + 1
    pub.publish(direct(10))
    kept = _rows(r, KEYS.results("direct"))
    assert len(kept) <= 2 and kept[-1].request_id == "0-10"  # the old rows are gone
    assert r.xlen(KEYS.results("j")) == 1  # job streams are not trimmed (the export ends them)
    # a long retention keeps everything
    pub = Publisher(r, KEYS, direct_retention_s=3600)
    for i in range(11, 20):
        pub.publish(direct(i))
    assert len(_rows(r, KEYS.results("direct"))) == len(kept) + 9
    with pytest.raises(ValueError, match="direct_retention_s"):
        Publisher(r, KEYS, direct_retention_s=0)


def test_the_retention_is_a_setting_the_daemons_use(redis_server):
    env = {"BATCHINFER_DIRECT_RESULTS_RETENTION_SECONDS": "3600"}
    settings = Settings.from_env(env, prefix=PREFIX)
    assert settings.direct_results_retention_seconds == 3600
    assert Settings.from_env({}).direct_results_retention_seconds == 7 * 24 * 3600
    r = redis_server.client()
    sched = SchedulerDaemon(r, settings)
    assert sched.intake.sink.publisher.direct_retention_ms == 3600 * 1000
    worker = worker_daemon(r, settings, EchoEngine(), "w1")
    assert worker.publisher.direct_retention_ms == 3600 * 1000
