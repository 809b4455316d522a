"""Cancelling a direct request (``Client.cancel_request``: ``ZADD {p}:cancelled:requests``, docs/protocol.md):
a worker that holds it ends it with a ``cancelled`` row on its reply stream; a staged one is answered
so by the scheduler and never reaches a batch; cancels older than an hour are ignored and trimmed.

The scheduler runs in the test's thread (``run_once``), an echo worker in a thread beside it."""

from __future__ import annotations

import json
import time

from daemons import ThreadedWorker, wait_until, worker_daemon

from batchinfer.client.client import Client
from batchinfer.config import Settings
from batchinfer.keys import Keys
from batchinfer.protocol.entries import IntakeEntry
from batchinfer.protocol.rows import ResultRow
from batchinfer.redis_conn import as_text
from batchinfer.scheduler.daemon import SchedulerDaemon
from batchinfer.scheduler.staging import Staging
from batchinfer.store.registry import Registry
from batchinfer.workers.service.echo_engine import EchoEngine, byte_tokenizer_files
from batchinfer.workers.service.feeder import Cancellations

KEYS = Keys("{dc}")
REPLY = KEYS.reply("t")


def settings(redis_server) -> Settings:
    return Settings(redis_url=redis_server.url, prefix=KEYS.prefix, heartbeat_seconds=0.3)


def scheduler(r) -> SchedulerDaemon:
    sched = SchedulerDaemon(r, Settings(prefix=KEYS.prefix), direct_hold_s=600)
    sched.admission.models.refresh = 0
    return sched


def send(r, name: str, max_tokens: int = 4) -> str:
    """A direct request for the echo model; returns its request id (the intake entry id)."""
    body = json.dumps({"custom_id": name, "model": "echo", "prompt": f"say {name}", "max_tokens": max_tokens})
    return as_text(r.xadd(KEYS.requests, IntakeEntry(body=body, reply_to=REPLY).to_fields()))


def replies(r) -> dict[str, ResultRow]:
    """The rows on the reply stream by custom_id."""
    found = (ResultRow.from_json(f[b"row"]) for _, f in r.xrange(REPLY))
    return {row.custom_id or "": row for row in found}


class HoldingEcho(EchoEngine):
    """An echo engine that never finishes the requests ``hold(engine_id)`` picks: only an abort (the
    worker ending a cancelled request) takes them out. Without it the cancelled request could finish
    first: a CI run saw "last" completed by the 0.3 s step already under way when its cancel landed."""

    def __init__(self, hold, **kwargs):
        super().__init__(**kwargs)
        self.hold = hold

    def step(self):
        held = {rid: req for rid, req in self._waiting.items() if self.hold(rid)}
        for rid in held:
            del self._waiting[rid]
        try:
            return super().step()
        finally:
            self._waiting.update(held)  # still last in arrival order


def test_a_direct_request_a_worker_holds_ends_cancelled(redis_server):
    r = redis_server.client()
    ids: dict[str, str] = {}

    def is_last(engine_id: str) -> bool:  # an id the book does not know is never "last"
        rid = worker.daemon.book.engine_ids.get(engine_id)
        return rid is not None and rid == ids.get("last")

    engine = HoldingEcho(is_last, requests_per_step=1, step_delay=0.05, max_num_seqs=8)
    worker = ThreadedWorker(worker_daemon(r, settings(redis_server), engine, name="w1",
                                          cancel_poll_seconds=0.05, block_ms=50))
    try:
        sched = scheduler(r)
        ids.update({name: send(r, name) for name in ("a", "b", "c", "d", "e", "last")})
        # one request finishes per step, in arrival order; "last" never does on its own
        wait_until(lambda: ids["last"] in worker.daemon.book.running and len(replies(r)) == 5,
                   tick=sched.run_once, what="the others answered and the last request running in the worker")
        assert "last" not in replies(r)
        Client(settings=settings(redis_server)).cancel_request(ids["last"])
        wait_until(lambda: len(replies(r)) == 6, tick=sched.run_once, what="a row for every request")
    finally:
        assert worker.stop() == 0
    got = replies(r)
    row = got["last"]
    assert (row.status, row.error_code, row.worker) == ("cancelled", "cancelled", "w1"), row
    assert row.request_id == ids["last"] and row.started_at is not None  # it had entered the engine
    assert got["a"].status == "completed"  # the others ran as usual
    assert [as_text(m) for m in r.zrange(KEYS.cancelled_requests, 0, -1)] == [ids["last"]]


def test_a_staged_direct_request_that_is_cancelled_never_runs(redis_server):
    r = redis_server.client()
    engine = EchoEngine()
    Registry(r, KEYS).register_model("echo", byte_tokenizer_files(), engine.capacity())
    sched = scheduler(r)
    gone = send(r, "gone")
    send(r, "kept")
    wait_until(lambda: Staging(r, KEYS).count("echo") == 2, tick=sched.run_once,
               what="both staged (no worker is live yet)")
    Client(settings=settings(redis_server)).cancel_request(gone)
    worker = ThreadedWorker(worker_daemon(r, settings(redis_server), engine, name="w1", block_ms=50))
    try:
        wait_until(lambda: len(replies(r)) == 2, tick=sched.run_once, what="both rows")
    finally:
        assert worker.stop() == 0
    got = replies(r)
    assert got["kept"].status == "completed"
    row = got["gone"]
    assert (row.status, row.error_code, row.request_id) == ("cancelled", "cancelled", gone)
    assert row.worker is None and row.started_at is None  # answered by the scheduler, never in a batch
    assert engine.num_generated_tokens == got["kept"].completion_tokens  # only "kept" was generated


def test_cancels_older_than_an_hour_are_ignored_by_workers_and_trimmed_by_the_scheduler(redis_server):
    r = redis_server.client()
    now = int(time.time() * 1000)
    r.zadd(KEYS.cancelled_requests, {"1-0": now - 2 * 3600 * 1000, "2-0": now})
    cancels = Cancellations(KEYS)
    cancels.poll(r)
    assert cancels.take() is not None
    assert cancels.requests == {"2-0"}
    assert cancels.cancelled(None, "2-0") and not cancels.cancelled(None, "1-0")
    assert not cancels.cancelled("job", "2-0")  # a job's request is cancelled by its job only
    scheduler(r).accounting.step()
    assert [as_text(m) for m in r.zrange(KEYS.cancelled_requests, 0, -1)] == ["2-0"]
