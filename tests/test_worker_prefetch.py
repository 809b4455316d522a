"""The worker's prefetch thread (``workers.service.reader.Prefetcher``) against a real redis-server: a
batch read ahead is held (its lease refreshed) and reported before the engine thread takes it, a
drain finishes it, a hard stop leaves it pending to the worker (its restart takes it back), no batch
is read twice by two workers reading ahead, a slow engine never makes a worker hold more
unstarted work than one batch, and a busy worker's empty reads back off."""

from __future__ import annotations

import json
import threading
import time

from daemons import ThreadedWorker, wait_until, worker_daemon
from faulty_echo import FaultyEchoEngine

from batchinfer.config import Settings
from batchinfer.keys import WORKERS_GROUP, Keys
from batchinfer.protocol.rows import BatchRequest
from batchinfer.store.jobstore import JobStore
from batchinfer.store.publish import Publisher
from batchinfer.store.registry import Registry
from batchinfer.workers.service.echo_engine import EchoEngine
from batchinfer.workers.service.reader import PREFETCH_DEPTH, QUIET_CAP_S, QUIET_START_S, Prefetcher

PREFIX = "{pf}"
KEYS = Keys(PREFIX)
STREAM = KEYS.batches("echo")


def _settings(**kw) -> Settings:
    return Settings(prefix=PREFIX, heartbeat_seconds=kw.pop("heartbeat_seconds", 0.3), **kw)


def _job(r, job: str, n: int, per_batch: int) -> list[str]:
    """A job of ``n`` requests dispatched as batches of ``per_batch``; returns the batch entry ids."""
    JobStore(r, KEYS).create(job, model="echo")
    reqs = [BatchRequest(request_id=f"{job}:{i}", job_id=job, idx=i, prompt_token_ids=[10 + i % 50, 20, 30],
                         sampling_params={"max_tokens": 3, "temperature": 0.0}, model="echo", line=i + 1,
                         custom_id=f"c{i}", created_at=1) for i in range(n)]
    if not r.exists(STREAM):
        r.xgroup_create(STREAM, WORKERS_GROUP, id="0", mkstream=True)
    entries = []
    for start in range(0, n, per_batch):
        body = json.dumps([q.to_dict() for q in reqs[start:start + per_batch]])
        entries.append(r.xadd(STREAM, {"v": "1", "requests": body}).decode())
    Publisher(r, KEYS).finish_submission(job, n)
    return entries


def _rows(r, job: str) -> list[dict]:
    return [json.loads(f[b"row"]) for _, f in r.xrange(KEYS.results(job))]


def _pending(r) -> dict[str, str]:
    """Entry id -> the consumer it is pending to."""
    return {p["message_id"].decode(): p["consumer"].decode()
            for p in r.xpending_range(STREAM, WORKERS_GROUP, "-", "+", 100)}


def test_a_batch_read_ahead_is_held_lease_kept_and_reported_until_taken(redis_server):
    r = redis_server.client()
    first, second = _job(r, "jp", 4, per_batch=2)
    daemon = worker_daemon(r, _settings(heartbeat_seconds=0.2, lease_seconds=0.6), EchoEngine(), "w1")
    daemon.reader.ensure_groups()
    daemon.keeper.start()
    daemon.prefetcher.start()
    try:
        daemon.prefetcher.want(False)  # what the engine thread says after a feed with room left
        wait_until(lambda: daemon.prefetcher.num_batches() == 1, what="a batch read ahead")
        time.sleep(0.3)
        assert daemon.prefetcher.num_batches() == PREFETCH_DEPTH == 1  # one read ahead, no more
        assert _pending(r) == {first: "w1"} and not daemon.book.batches  # read, not in the book
        time.sleep(3 * 0.6)  # three leases: the keeper re-claims it like any held batch
        (entry,) = r.xpending_range(STREAM, WORKERS_GROUP, "-", "+", 10)
        assert entry["consumer"] == b"w1" and entry["time_since_delivered"] < 600
        daemon.keeper.heartbeat()
        (info,) = [w.info for w in Registry(r, KEYS).live_workers("echo")]
        assert info["prefetched"] == 1 and info["batches"] == 0
        (fetched,) = daemon.prefetcher.take()
        assert fetched.entry == first and fetched.published == [False, False]
        assert [q.request_id for q in fetched.requests] == ["jp:0", "jp:1"]
        params = fetched.params.values()
        assert len(params) == 2 and all(p.output_kind == "final_only" for p in params)
        daemon.reader.admit(fetched)
        assert set(daemon.book.batches) == {first} and len(daemon.book.held) == 2
        time.sleep(0.3)  # taking cleared the demand: nothing more is read until the loop asks again
        assert daemon.prefetcher.num_batches() == 0 and set(_pending(r)) == {first}
        daemon.prefetcher.want(False)
        wait_until(lambda: daemon.prefetcher.num_batches() == 1, what="the second batch read ahead")
        assert set(_pending(r)) == {first, second}
    finally:
        daemon.prefetcher.stop()
        daemon.keeper.stop()
        daemon.outbox.stop()


def _first_batch_running_second_read_ahead(r, name: str = "w1"):
    """A daemon (not yet looping) that has run one iteration: the first batch of job ``jd`` in the
    engine, the second read ahead by the prefetch thread and not yet in the book."""
    first, second = _job(r, "jd", 4, per_batch=2)
    daemon = worker_daemon(r, _settings(), EchoEngine(max_num_seqs=2, requests_per_step=1), name)
    daemon._start()
    daemon._iteration()  # takes the first batch (waiting for it), feeds it, asks for more, steps
    wait_until(lambda: daemon.prefetcher.num_batches() == 1, what="the second batch read ahead")
    assert set(daemon.book.batches) == {first}
    return daemon, first, second


def test_a_drain_finishes_a_batch_read_ahead(redis_server):
    r = redis_server.client()
    daemon, _first, _second = _first_batch_running_second_read_ahead(r)
    stop = threading.Event()
    stop.set()  # SIGTERM before the loop took the batch read ahead
    assert daemon.run(stop) == 0
    rows = _rows(r, "jd")
    assert sorted(x["idx"] for x in rows) == [0, 1, 2, 3]
    assert all(x["status"] == "completed" and x["worker"] == "w1" for x in rows)
    assert _pending(r) == {} and r.xlen(STREAM) == 0  # everything acked: nothing left to a lease


def test_a_hard_stop_leaves_a_batch_read_ahead_to_the_worker_s_restart(redis_server):
    r = redis_server.client()
    daemon, first, second = _first_batch_running_second_read_ahead(r)
    daemon.hard_stop.set()  # a second SIGTERM
    assert daemon.run(threading.Event()) == 1
    assert not daemon.prefetcher._thread.is_alive()
    assert _pending(r) == {first: "w1", second: "w1"}  # both left to their leases, as a crash leaves them
    # a restart under the same name takes them back
    worker = ThreadedWorker(worker_daemon(r, _settings(), EchoEngine(), "w1"))
    wait_until(lambda: len(_rows(r, "jd")) == 4, what="every row after the restart")
    assert worker.stop() == 0
    assert sorted(x["idx"] for x in _rows(r, "jd")) == [0, 1, 2, 3] and _pending(r) == {}


def test_two_workers_reading_ahead_never_read_a_batch_twice(redis_server):
    r = redis_server.client()
    entries = _job(r, "jt", 60, per_batch=3)
    started: list[str] = []
    admitted: list[str] = []
    workers = []
    for name in ("w1", "w2"):
        engine = FaultyEchoEngine(max_num_seqs=4, requests_per_step=2, step_delay=0.005,
                                  fault_hook=started.append)
        daemon = worker_daemon(r, _settings(), engine, name)
        admit = daemon.reader.admit

        def spy(fetched, admit=admit):
            admitted.append(fetched.entry)
            admit(fetched)

        daemon.reader.admit = spy
        workers.append(ThreadedWorker(daemon))
    wait_until(lambda: len(_rows(r, "jt")) == 60, what="60 rows")
    assert [w.stop() for w in workers] == [0, 0]
    assert sorted(admitted) == sorted(entries)  # each batch read once, by one worker
    assert sorted(started) == sorted(f"jt:{i}" for i in range(60))  # each request ran once
    rows = _rows(r, "jt")
    assert len(rows) == 60 and {x["worker"] for x in rows} == {"w1", "w2"}


class WatchedEcho(EchoEngine):
    """The echo engine, noting at the start and the end of every step the requests its worker holds
    unstarted (waiting in the book, or in batches read ahead), and the batches read ahead."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.daemon = None
        self.seen: list[tuple[int, int]] = []

    def _note(self) -> None:
        d = self.daemon
        self.seen.append((d.book.num_unstarted + d.prefetcher.num_requests(), d.prefetcher.num_batches()))

    def step(self):
        self._note()
        try:
            return super().step()
        finally:
            self._note()


def test_a_slow_engine_never_makes_the_worker_hold_more_than_one_batch_unstarted(redis_server):
    r = redis_server.client()
    _job(r, "js", 48, per_batch=4)  # 12 batches, 4 requests each: one fills the engine
    engine = WatchedEcho(max_num_seqs=4, requests_per_step=1, step_delay=0.01)
    daemon = worker_daemon(r, _settings(), engine, "w1")
    engine.daemon = daemon
    worker = ThreadedWorker(daemon)
    wait_until(lambda: len(engine.seen) >= 20, what="some steps")
    last = r.xinfo_groups(STREAM)[0]["last-delivered-id"].decode()
    assert len(r.xrange(STREAM, min=f"({last}", max="+")) >= 6  # most batches still wait for anyone
    wait_until(lambda: len(_rows(r, "js")) == 48, what="48 rows")
    assert worker.stop() == 0
    assert max(unstarted for unstarted, _ in engine.seen) <= 4  # never more than one batch unstarted
    assert max(ahead for _, ahead in engine.seen) == PREFETCH_DEPTH  # it did read ahead during steps


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_busy_worker_s_empty_reads_back_off_and_a_batch_still_arrives(redis_server):
    """After a busy read finds nothing, busy asks within the quiet spell (QUIET_START_S, doubling up
    to QUIET_CAP_S) read nothing; the first ask after it reads, and a batch found ends the backoff.
    An idle ask reads at once."""
    r = redis_server.client()
    r.xgroup_create(STREAM, WORKERS_GROUP, id="0", mkstream=True)
    daemon = worker_daemon(r, _settings(), EchoEngine(), "wq", block_ms=50)
    reads: list[int] = []
    read = daemon.reader.read

    def counted(idle, block_ms):
        got = read(idle, block_ms)
        reads.append(len(got))
        return got

    daemon.reader.read = counted
    clock = _Clock()
    p = Prefetcher(daemon.reader, block_ms=50, clock=clock)
    p.start()
    try:
        def ask(n_reads: int) -> None:
            p.want(False)
            wait_until(lambda: len(reads) == n_reads and not p._busy, what=f"{n_reads} reads")

        ask(1)  # nothing there: a quiet spell of QUIET_START_S begins
        assert reads == [0]
        for _ in range(3):
            p.want(False)  # inside the spell: no read (and no wake-up)
        time.sleep(0.05)
        assert reads == [0]
        clock.now += QUIET_START_S * 1.01
        ask(2)  # the spell is over: one read, empty again, so the next spell is twice as long
        clock.now += QUIET_START_S * 1.5
        p.want(False)
        time.sleep(0.05)
        assert reads == [0, 0]
        entries = _job(r, "jq", 4, per_batch=4)
        clock.now += QUIET_START_S * 0.6  # 2.1 x QUIET_START_S since the last read
        ask(3)
        assert reads == [0, 0, 1]
        assert [f.entry for f in p.take()] == entries  # found: the backoff is over
        ask(4)  # the next busy ask reads at once
        assert reads == [0, 0, 1, 0]
        p.want(True)  # idle: reads whatever the spell (and waits in Redis up to block_ms)
        wait_until(lambda: len(reads) == 5, what="the idle read")
        for _ in range(20):  # the spell never grows past QUIET_CAP_S
            p._quiet_until = 0.0
            ask(len(reads) + 1)
        assert p._quiet_s == QUIET_CAP_S
    finally:
        p.stop()


def test_the_heartbeat_reports_the_helper_threads_cpu(redis_server):
    """publisher_cpu_s and prefetch_cpu_s: the publisher and prefetch threads' CPU seconds so far
    (each thread reads its own clock), beside the engine thread's engine_s and loop_overhead_s."""
    r = redis_server.client()
    _job(r, "jc", 24, per_batch=8)
    daemon = worker_daemon(r, _settings(), EchoEngine(max_num_seqs=8), "wc")
    worker = ThreadedWorker(daemon)
    wait_until(lambda: len(_rows(r, "jc")) == 24, what="24 rows")

    def beat():
        info = next((w.info for w in Registry(r, KEYS).live_workers() if w.name == "wc"), None)
        return info if info and int(info.get("requests_done", 0)) == 24 else None

    info = wait_until(beat, what="a heartbeat counting the 24 rows")
    assert worker.stop() == 0
    assert 0 < float(info["publisher_cpu_s"]) < 60 and 0 < float(info["prefetch_cpu_s"]) < 60
    assert float(info["engine_s"]) > 0 and float(info["loop_overhead_s"]) >= 0
