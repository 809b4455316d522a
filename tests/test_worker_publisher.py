"""The worker's publisher thread (``workers.service.outbox.PublisherThread``) against a real redis-server:
hand-overs never wait on Redis until the bounded queue is full, rows wait out an outage and are
published once, a drain publishes everything, and the daemon's engine steps go on while Redis is
paused (SIGSTOP: commands hang, data stays)."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from daemons import ThreadedWorker, wait_until, worker_daemon

from batchinfer.config import Settings
from batchinfer.keys import DIRECT, WORKERS_GROUP, Keys
from batchinfer.ops.metrics import WorkerMetrics
from batchinfer.protocol.rows import BatchRequest, ResultRow
from batchinfer.redis_conn import own_client
from batchinfer.store.jobstore import JobStore
from batchinfer.store.publish import Publisher, ReplicasBehind
from batchinfer.workers.service.echo_engine import EchoEngine
from batchinfer.workers.service.inflight import Book
from batchinfer.workers.service.outbox import Outbox, PublisherStopped, PublisherThread
from batchinfer.workers.service.streams import BatchStreams

PREFIX = "{pt}"
KEYS = Keys(PREFIX)


def _request(job: str | None, idx: int, max_tokens: int = 4) -> BatchRequest:
    rid = f"{job}:{idx}" if job else f"d{idx}"
    return BatchRequest(request_id=rid, job_id=job, idx=idx if job else None, prompt_token_ids=[5, 6, 7],
                        sampling_params={"max_tokens": max_tokens, "temperature": 0.0}, model="echo",
                        line=idx + 1, custom_id=f"c{idx}", created_at=1)


def _row(q: BatchRequest) -> ResultRow:
    return ResultRow(job_id=q.job_id, request_id=q.request_id, idx=q.idx, status="completed", model="echo")


def _dispatch(r, requests: list[BatchRequest]) -> str:
    """What the scheduler does: one batch entry on the model's stream."""
    if not r.exists(KEYS.batches("echo")):
        r.xgroup_create(KEYS.batches("echo"), WORKERS_GROUP, id="0", mkstream=True)
    fields = {"v": "1", "requests": json.dumps([q.to_dict() for q in requests])}
    return r.xadd(KEYS.batches("echo"), fields).decode()


def _rows(r, job: str) -> list[dict]:
    return [json.loads(f[b"row"]) for _, f in r.xrange(KEYS.results(job))]


def _publisher(r, **kw) -> PublisherThread:
    own = own_client(r)
    outbox = Outbox(own, KEYS, BatchStreams(KEYS, "echo"), Publisher(own, KEYS),
                    enqueue_export=lambda job: None, on_published=lambda rows: None,
                    on_acked=lambda keys: None, max_attempts=3)
    return PublisherThread(outbox, **kw)


@contextmanager
def paused(server) -> Iterator[None]:
    """Redis stopped mid-flight (SIGSTOP): every command waits, nothing is lost."""
    os.kill(server.proc.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)


def _settle(pub: PublisherThread, book: Book, expected: int) -> None:
    """Take confirmations (as the engine thread does) until ``expected`` rows came back."""
    got = [0]

    def more() -> bool:
        got[0] += pub.flush(book)
        return got[0] >= expected

    wait_until(more, what=f"{expected} rows confirmed")
    assert got[0] == expected


def test_hand_overs_wait_for_a_paused_redis_only_once_the_queue_is_full(redis_server):
    r = redis_server.client()
    JobStore(r, KEYS).create("jp", model="echo")
    reqs = [_request("jp", i) for i in range(6)]
    entry = _dispatch(r, reqs)
    book = Book()
    book.add_batch(entry, reqs, [False] * 6)
    pub = _publisher(r, maxsize=4, linger_s=0)  # no gathering: the thread blocks on Redis at once
    with paused(redis_server):
        pub.add(_row(reqs[0]))
        assert pub.flush(book) == 0  # one hand-over per flush (a loop iteration)
        wait_until(lambda: pub.queued() == 0, what="the thread to take the first row")  # it waits on Redis
        began = time.monotonic()
        for q in reqs[1:5]:
            pub.add(_row(q))
            pub.flush(book)  # room in the queue: no wait
        assert time.monotonic() - began < 0.5

        def last() -> None:
            pub.add(_row(reqs[5]))
            pub.flush(book)

        late = threading.Thread(target=last, daemon=True)
        late.start()
        late.join(0.5)
        assert late.is_alive()  # the queue is full: the hand-over waits (backpressure), nothing dropped
        assert not pub.empty()
    late.join(10)
    assert not late.is_alive()
    _settle(pub, book, 6)
    wait_until(pub.empty, what="the ack sent")
    pub.stop()
    assert sorted(x["idx"] for x in _rows(r, "jp")) == list(range(6))
    assert r.xlen(KEYS.batches("echo")) == 0  # acked and deleted once all six were published


def test_rows_handed_over_during_an_outage_are_published_once_redis_is_back(redis_server):
    r = redis_server.client()
    reqs = [_request(None, i) for i in range(3)]
    book = Book()
    book.add_batch("1-0", reqs, [False] * 3)
    pub = _publisher(r)
    pub.start()
    redis_server.stop()
    for q in [*reqs, reqs[0]]:  # the first row twice: a re-run's
        pub.add(_row(q))
    assert pub.flush(book) == 0  # handed over without waiting for Redis
    time.sleep(1.0)  # the thread fails and backs off; the rows wait in its outbox
    assert pub.flush(book) == 0 and not pub.empty()
    redis_server.start()  # an empty Redis (no persistence in tests): the script is loaded again
    r = redis_server.client()
    _settle(pub, book, 4)
    wait_until(pub.empty, what="the ack sent")
    pub.stop()
    assert sorted(x["request_id"] for x in _rows(r, DIRECT)) == ["d0", "d1", "d2"]  # exactly once
    assert book.empty()


def test_rows_of_a_job_whose_record_vanished_are_dropped_and_the_batch_is_acked(redis_server):
    """A Redis restart without persistence mid-job: the record is gone, the worker still holds the
    batch. Its rows create no orphan results stream, are counted, and the batch is acked (settled),
    not run again."""
    r = redis_server.client()
    JobStore(r, KEYS).create("jv", model="echo")
    reqs = [_request("jv", i) for i in range(6)]
    entry = _dispatch(r, reqs)
    r.xreadgroup(WORKERS_GROUP, "w1", {KEYS.batches("echo"): ">"})  # the worker holds the batch
    book = Book()
    book.add_batch(entry, reqs, [False] * 6)
    metrics, published = WorkerMetrics("echo"), []
    own = own_client(r)
    outbox = Outbox(own, KEYS, BatchStreams(KEYS, "echo"), Publisher(own, KEYS, metrics=metrics),
                    enqueue_export=lambda job: None, on_published=published.extend,
                    on_acked=lambda keys: None, max_attempts=3)
    pub = PublisherThread(outbox)
    pub.add(_row(reqs[0]))
    _settle(pub, book, 1)
    assert len(_rows(r, "jv")) == 1
    r.delete(KEYS.job("jv"), KEYS.results("jv"), KEYS.published("jv"))  # what the restart lost
    for q in reqs[1:]:
        pub.add(_row(q))
    _settle(pub, book, 5)  # dropped rows settle their requests as published ones do
    wait_until(pub.empty, what="the ack sent")
    pub.stop()
    assert not r.exists(KEYS.results("jv")) and not r.exists(KEYS.published("jv"))
    assert [row.idx for row in published] == [0]
    assert metrics.registry.get_sample_value("batchinfer_rows_dropped_total", {"reason": "no_job"}) == 5
    assert r.xpending(KEYS.batches("echo"), WORKERS_GROUP)["pending"] == 0  # acked: not re-run
    assert r.xlen(KEYS.batches("echo")) == 0 and book.empty()


def test_a_hard_stop_gives_up_a_blocked_hand_over(redis_server):
    r = redis_server.client()
    hard = threading.Event()
    pub = _publisher(r, maxsize=1, hard_stop=hard, linger_s=0)
    reqs = [_request(None, i) for i in range(3)]
    with paused(redis_server):
        pub.add(_row(reqs[0]))
        pub.flush(Book())
        wait_until(lambda: pub.queued() == 0, what="the thread to take the first row")
        pub.add(_row(reqs[1]))
        pub.flush(Book())  # fills the queue
        hard.set()
        pub.add(_row(reqs[2]))
        with pytest.raises(PublisherStopped):
            pub.flush(Book())
    pub.stop()
    assert not pub._thread.is_alive()  # what it had not sent is left to the leases


def _counting_sends(monkeypatch) -> list[int]:
    """Rows per row-publishing call of the publisher thread's outbox, as they happen."""
    from batchinfer.workers.service import outbox as outbox_module

    sizes: list[int] = []
    real = outbox_module.publish_then_export

    def counted(publisher, rows, *args, **kwargs):
        sizes.append(len(rows))
        return real(publisher, rows, *args, **kwargs)

    monkeypatch.setattr(outbox_module, "publish_then_export", counted)
    return sizes


def _held(book: Book, entry: str, idxs: range) -> list[BatchRequest]:
    """Direct requests of one batch entry, held in ``book`` as the worker holds what it read."""
    reqs = [_request(None, i) for i in idxs]
    book.add_batch(entry, reqs, [False] * len(reqs))
    return reqs


def test_hand_overs_within_the_linger_go_out_in_one_send(redis_server, monkeypatch):
    """A busy engine hands rows over every step: the thread gathers them for ``linger_s`` and sends
    them together, where it sent each step's few rows on their own."""
    r = redis_server.client()
    sizes = _counting_sends(monkeypatch)
    book = Book()
    reqs = _held(book, "1-0", range(6))
    pub = _publisher(r, linger_s=1.0)  # the six hand-overs take microseconds: all inside it
    for q in reqs:  # six loop iterations, a row each
        pub.add(_row(q))
        pub.flush(book)
    _settle(pub, book, 6)
    wait_until(pub.empty, what="the ack sent")
    pub.stop()
    assert sizes == [6]
    assert sorted(x["request_id"] for x in _rows(r, DIRECT)) == [f"d{i}" for i in range(6)]

    sizes.clear()  # without a linger, the same hand-overs as they come
    pub = _publisher(r, linger_s=0, maxsize=1)
    for q in _held(book, "2-0", range(6, 9)):
        pub.add(_row(q))
        pub.flush(book)
        _settle(pub, book, 1)  # each send done before the next hand-over
    wait_until(pub.empty, what="the ack sent")
    pub.stop()
    assert sizes == [1, 1, 1]


def test_an_urgent_flush_ends_the_linger(redis_server, monkeypatch):
    """Nothing left running in the engine (``urgent``): the rows go out at once, not after the
    linger, so a job's last rows are not held back."""
    r = redis_server.client()
    sizes = _counting_sends(monkeypatch)
    book = Book()
    reqs = _held(book, "1-0", range(2))
    pub = _publisher(r, linger_s=60.0)
    pub.add(_row(reqs[0]))
    pub.flush(book)
    time.sleep(0.3)
    assert sizes == [] and pub.flush(book) == 0  # lingering: nothing sent yet
    began = time.monotonic()
    pub.add(_row(reqs[1]))
    pub.flush(book, urgent=True)
    _settle(pub, book, 2)
    assert time.monotonic() - began < 30  # long before the minute's linger
    assert sizes == [2]
    pub.flush(book, urgent=True)  # the acks the confirmations handed over go out at once too
    wait_until(pub.empty, timeout=30, what="the ack sent")
    began = time.monotonic()
    pub.stop()  # ``stop`` ends a linger too
    assert time.monotonic() - began < 5 and not pub._thread.is_alive()


def _worker(r, engine: EchoEngine) -> ThreadedWorker:
    settings = Settings(prefix=PREFIX, heartbeat_seconds=0.3)
    return ThreadedWorker(worker_daemon(r, settings, engine, "w1", block_ms=50))


def test_engine_steps_go_on_while_redis_is_paused(redis_server):
    r = redis_server.client()
    JobStore(r, KEYS).create("js", model="echo")
    reqs = [_request("js", i) for i in range(40)]
    Publisher(r, KEYS).finish_submission("js", 40)
    _dispatch(r, reqs)  # one batch: 4 in the engine, the rest waiting, nothing more to pull
    worker = _worker(r, EchoEngine(max_num_seqs=4, requests_per_step=1, step_delay=0.02))
    daemon = worker.daemon
    wait_until(lambda: len(daemon.book.held) == 40 and daemon.steps > 0)
    with paused(redis_server):
        # a few steps in, a send answered just before the pause has been handed back
        paused_at = daemon.steps
        wait_until(lambda: daemon.steps >= paused_at + 3, what="steps while Redis is paused")
        steps, done = daemon.steps, daemon.requests_done
        # the engine thread does not wait on Redis ...
        wait_until(lambda: daemon.steps >= steps + 5, what="more steps while Redis is paused")
        assert daemon.requests_done == done  # ... while no row can be published
    wait_until(lambda: len(_rows(r, "js")) == 40, what="40 rows")
    assert worker.stop() == 0
    assert sorted(x["idx"] for x in _rows(r, "js")) == list(range(40))
    assert r.hget(KEYS.job("js"), "status") == b"finalizing"


def test_a_drain_publishes_every_row_before_it_exits(redis_server):
    r = redis_server.client()
    JobStore(r, KEYS).create("jd", model="echo")
    reqs = [_request("jd", i) for i in range(12)]
    Publisher(r, KEYS).finish_submission("jd", 12)
    _dispatch(r, reqs)
    worker = _worker(r, EchoEngine(requests_per_step=4, step_delay=0.02))
    daemon = worker.daemon
    wait_until(lambda: len(daemon.book.held) == 12)
    worker.stop_event.set()  # SIGTERM: drain (no more pulling)
    with paused(redis_server):
        wait_until(lambda: not daemon.engine.has_unfinished(), what="every request finished")
        time.sleep(0.3)
        assert worker.thread.is_alive()  # rows still wait for Redis: no exit yet
    assert worker.stop() == 0
    # at once, no waiting: the drain returned only after every row was published and acked
    assert sorted(x["idx"] for x in _rows(r, "jd")) == list(range(12))
    assert r.xlen(KEYS.batches("echo")) == 0


def test_rows_wait_in_the_outbox_until_replicas_have_them(redis_server):
    """BATCHINFER_REPLICA_ACKS on a server with no replica: the rows are on the master but stay in
    the outbox (neither confirmed nor acked, sent again with backoff); once replicas answer, each
    row counts as published once, by the attempt that wrote it, and its batch is acked."""
    r = redis_server.client()
    JobStore(r, KEYS).create("jr", model="echo")
    reqs = [_request("jr", i) for i in range(2)]
    entry = _dispatch(r, reqs)
    r.xreadgroup(WORKERS_GROUP, "w", {KEYS.batches("echo"): ">"})
    own = own_client(r)
    publisher = Publisher(own, KEYS, replica_acks=1, replica_timeout_ms=20)
    published, acked = [], []
    outbox = Outbox(own, KEYS, BatchStreams(KEYS, "echo"), publisher, enqueue_export=lambda job: None,
                    on_published=published.extend, on_acked=acked.extend, max_attempts=3)
    for q in reqs:
        outbox.add(_row(q))
    with pytest.raises(ReplicasBehind):
        outbox.send()
    assert len(_rows(r, "jr")) == 2  # on the master
    assert len(outbox.rows) == 2 and outbox.confirmed == [] and published == []
    with pytest.raises(ReplicasBehind):
        outbox.send()  # the retry finds them published: still not counted twice, still held
    assert published == [] and outbox.won == {q.request_id for q in reqs}

    publisher.replica_acks = 0  # the replicas caught up (what a WAIT answering 1 would say)
    outbox.send()
    assert [row.request_id for row in published] == [q.request_id for q in reqs]  # once each
    assert not outbox.rows and not outbox.won and len(_rows(r, "jr")) == 2
    book = Book()
    book.add_batch(entry, reqs, [False] * 2)
    outbox.settle(book)
    publisher.replica_acks = 1  # the acks wait for the replica too: held until it answers
    with pytest.raises(ReplicasBehind):
        outbox.send_acks()
    assert outbox.acks == [entry] and acked == []
    publisher.replica_acks = 0
    outbox.send_acks()
    assert acked == [entry] and r.xpending(KEYS.batches("echo"), WORKERS_GROUP)["pending"] == 0
