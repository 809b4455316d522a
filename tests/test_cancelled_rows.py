"""Every ``cancelled`` row carries its request's ``custom_id`` (issue 28): a producer matches rows by
it, whichever stage the request was at when its job was cancelled — an intake entry not read yet,
held for a model no worker serves, staged, dispatched, or in a worker's engine.

The scheduler runs in the test's thread (``run_once``), an echo worker in a thread beside it."""

from __future__ import annotations

import json

from clocks import FakeClock
from daemons import ThreadedWorker, wait_until, worker_daemon

from batchinfer.config import Settings
from batchinfer.keys import Keys
from batchinfer.protocol.entries import IntakeEntry
from batchinfer.protocol.rows import ResultRow
from batchinfer.scheduler.daemon import SchedulerDaemon
from batchinfer.scheduler.staging import Staging, held_key
from batchinfer.store.jobstore import JobStore
from batchinfer.store.publish import Publisher
from batchinfer.workers.service.echo_engine import EchoEngine

KEYS = Keys("{cr}")


def body(i: int) -> str:
    """A valid body; its ``custom_id`` leads in even lines and trails in odd ones (a producer's
    JSON encoder chooses the order)."""
    fields = {"prompt": f"request {i}", "max_tokens": 3, "metadata": {"n": str(i)}}
    return json.dumps({"custom_id": f"c{i}", **fields} if i % 2 == 0 else {**fields, "custom_id": f"c{i}"})


def send(r, job: str, idxs: range) -> None:
    for i in idxs:
        r.xadd(KEYS.requests, IntakeEntry(body=body(i), job_id=job, idx=i, line=i + 1).to_fields())


def rows(r, job: str) -> dict[int, ResultRow]:
    return {row.idx: row for row in (ResultRow.from_json(f[b"row"]) for _, f in r.xrange(KEYS.results(job)))}


def scheduler(r, wall: FakeClock | None = None) -> SchedulerDaemon:
    sched = SchedulerDaemon(r, Settings(prefix=KEYS.prefix), direct_hold_s=600,
                            **({"wall_clock": wall.ms, "clock": wall} if wall else {}))
    sched.dispatcher.jobs.ttl = sched.admission.jobs.ttl = 0  # see the cancel at once
    sched.admission.models.refresh = 0
    return sched


def drain(sched: SchedulerDaemon) -> None:
    while sched.run_once():
        pass


def assert_identified(got: dict[int, ResultRow], total: int) -> list[int]:
    """Every idx has a row; every cancelled one names its custom_id and line; returns their idx."""
    assert sorted(got) == list(range(total))
    cancelled = sorted(i for i, row in got.items() if row.status == "cancelled")
    for i in cancelled:
        row = got[i]
        assert (row.custom_id, row.line, row.error_code) == (f"c{i}", i + 1, "cancelled"), row
    return cancelled


def test_rows_of_entries_cancelled_before_they_were_read_and_while_held_name_their_custom_id(redis_server):
    r = redis_server.client()
    store = JobStore(r, KEYS)
    store.create("j", model="nobody")  # no worker serves it: its entries are held
    wall = FakeClock.from_now()
    sched = scheduler(r, wall)
    send(r, "j", range(0, 4))
    drain(sched)
    assert r.xlen(held_key(KEYS)) == 4 and rows(r, "j") == {}
    store.cancel("j")
    send(r, "j", range(4, 8))  # arrive after the cancel, not read yet
    Publisher(r, KEYS).finish_submission("j", 8)
    wall.advance(5)  # the held sweep is due
    drain(sched)
    got = rows(r, "j")
    assert assert_identified(got, 8) == list(range(8))
    assert got[5].metadata == {"n": "5"}  # read from the body, as the request's own row would have
    assert r.xlen(held_key(KEYS)) == 0


def test_an_invalid_body_cancelled_before_it_was_read_keeps_a_leading_custom_id(redis_server):
    r = redis_server.client()
    store = JobStore(r, KEYS)
    store.create("k", model="nobody")
    store.cancel("k")
    r.xadd(KEYS.requests, IntakeEntry(body='{"custom_id": "bad", "prompt": 5}', job_id="k", idx=0,
                                      line=1).to_fields())
    drain(scheduler(r))
    row = rows(r, "k")[0]
    assert (row.status, row.custom_id) == ("cancelled", "bad")


def test_rows_cancelled_in_a_worker_dispatched_and_staged_name_their_custom_id(redis_server):
    r = redis_server.client()
    settings = Settings(prefix=KEYS.prefix, heartbeat_seconds=0.3)
    engine = EchoEngine(requests_per_step=1, step_delay=0.2, max_num_seqs=2)
    worker = ThreadedWorker(worker_daemon(r, settings, engine, name="w1", cancel_poll_seconds=0.05,
                                          block_ms=50))
    try:
        store = JobStore(r, KEYS)
        store.create("j", model="echo")
        sched = scheduler(r)
        send(r, "j", range(0, 30))
        Publisher(r, KEYS).finish_submission("j", 30)
        wait_until(lambda: sched.run_once() >= 0 and len(worker.daemon.book.running) == 2
                   and len(rows(r, "j")) >= 1, what="requests running in the worker")
        staged = Staging(r, KEYS).count("echo")
        store.cancel("j")
        wait_until(lambda: sched.run_once() >= 0 and len(rows(r, "j")) == 30, what="every row")
    finally:
        assert worker.stop() == 0
    got = rows(r, "j")
    cancelled = assert_identified(got, 30)
    assert staged > 0 and len(cancelled) > staged  # staged ones and the worker's own were cancelled
    assert all(got[i].metadata == {"n": str(i)} for i in cancelled)
    by_worker = [i for i in cancelled if got[i].worker == "w1"]
    assert by_worker, "the worker cancelled what it held (a step takes 0.2 s, the poll 0.05 s)"
