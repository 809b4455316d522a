"""Several schedulers on one queue (issue 32): one owns the work, the others stand by, and a
scheduler that lost the ownership writes nothing (``batchinfer/store/ownership.py``), against a real
redis-server. The subprocess kills and pauses are in tests/faults/test_scheduler_failover.py."""

from __future__ import annotations

import json
import time
from collections import Counter

import pytest
import redis
from daemons import dispatched, interleave, wait_until
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batchinfer.config import Settings
from batchinfer.keys import Keys
from batchinfer.protocol.entries import IntakeEntry
from batchinfer.protocol.rows import now_ms
from batchinfer.scheduler.daemon import SchedulerDaemon
from batchinfer.store.jobstore import JobStore
from batchinfer.store.ownership import NotOwner, Ownership
from batchinfer.store.registry import Registry
from batchinfer.workers.text.tokenizer_files import read_tokenizer_files

KEYS = Keys("{own}")
CAP = {"max_model_len": 128, "max_num_seqs": 4, "max_num_batched_tokens": 256, "kv_tokens": 4096}
TAKEOVER_S = 0.6  # short for the tests, long enough that a loaded machine does not lapse a lease by itself


def _ownership(r, name: str, takeover: float = TAKEOVER_S) -> Ownership:
    return Ownership(r, KEYS.scheduler_owner, KEYS.scheduler_epoch, takeover_seconds=takeover, name=name)


def test_one_owner_at_a_time_and_a_clean_stop_hands_over_at_once(redis_server):
    r = redis_server.client()
    a, b = _ownership(r, "a", takeover=30), _ownership(r, "b", takeover=30)
    assert a.tick() and not b.tick()
    assert a.owner() == a.token and a.token.startswith("a:")
    with pytest.raises(NotOwner, match="held by a:"):
        b.transaction()
    a.release()
    assert not a.held and b.tick() and b.owner() == b.token  # no wait for the lease to run out
    with pytest.raises(NotOwner):
        a.transaction()
    assert r.pttl(KEYS.scheduler_owner) > 29_000


def test_a_lapsed_owner_is_replaced_and_its_transactions_are_fenced(redis_server):
    r = redis_server.client()
    a, b = _ownership(r, "a"), _ownership(r, "b")
    assert a.tick()
    pipe = a.transaction()  # a starts a move ...
    pipe.set("moved", "by a")
    time.sleep(TAKEOVER_S + 0.1)  # ... and is paused past the takeover time
    assert b.tick()  # a standby took over
    with pytest.raises(redis.WatchError):
        pipe.execute()  # EXEC fails: the key changed hands since WATCH
    assert r.get("moved") is None
    with pytest.raises(NotOwner):  # a still believes it owns: the token check stops it
        a.transaction()
    assert a.held  # until its loop tells it (SchedulerDaemon.run_once: lost, then stand by)
    assert not a.tick() and not a.held  # its renewal finds b's token
    b_pipe = b.transaction()
    b_pipe.set("moved", "by b")
    b_pipe.execute()
    assert r.get("moved") == b"by b"


def test_the_renewal_thread_keeps_the_ownership_through_a_long_pass(redis_server):
    import threading

    r = redis_server.client()
    a, b = _ownership(r, "a"), _ownership(r, "b")
    assert a.tick()
    stop = threading.Event()
    thread = a.renew_while(stop)
    try:
        time.sleep(4 * TAKEOVER_S)  # a pass far longer than the takeover time, no tick meanwhile
        assert not b.tick() and a.owner() == a.token
        a.transaction().execute()  # still a's epoch: its writes go through
    finally:
        stop.set()
        thread.join(timeout=5)
    time.sleep(TAKEOVER_S + 0.1)  # no renewal now: the lease lapses, and while nobody takes over ...
    a.transaction().execute()  # ... a's epoch is still the current one: nobody else can write
    assert b.tick() and b.epoch == a.epoch + 1
    with pytest.raises(NotOwner, match="epoch"):
        a.transaction()


def test_renewal_keeps_the_ownership_past_the_takeover_time(redis_server):
    r = redis_server.client()
    a, b = _ownership(r, "a"), _ownership(r, "b")
    deadline = time.monotonic() + 3 * TAKEOVER_S
    while time.monotonic() < deadline:
        assert a.tick() and not b.tick()
        time.sleep(TAKEOVER_S / 6)
    with pytest.raises(ValueError, match="BATCHINFER_SCHEDULER_TAKEOVER_SECONDS"):
        _ownership(r, "c", takeover=0)


# -- two schedulers, one queue ------------------------------------------------------------------------


@pytest.fixture
def queue(redis_server, tiny_llama):
    r = redis_server.client()
    Registry(r, KEYS).register_model("tiny", read_tokenizer_files(tiny_llama), CAP)
    Registry(r, KEYS).heartbeat_worker("w1", {"model": "tiny", "capacity": CAP}, ttl=600)
    return r


def _scheduler(r, instance: str, takeover: float = TAKEOVER_S) -> SchedulerDaemon:
    sched = SchedulerDaemon(r, Settings(prefix=KEYS.prefix, scheduler_takeover_seconds=takeover),
                            instance=instance)
    sched.dispatcher.jobs.ttl = sched.admission.jobs.ttl = 0
    return sched


def _submit(r, job: str, n: int) -> None:
    JobStore(r, KEYS).create(job, model="tiny")
    for i in range(n):
        r.xadd(KEYS.requests, IntakeEntry(body=json.dumps({"prompt": f"p{i}", "max_tokens": 2}), job_id=job,
                                          idx=i, line=i + 1).to_fields())


def _dispatched(r) -> Counter:
    return dispatched(r, KEYS, "tiny")


def test_the_standby_does_nothing_until_the_owner_is_gone(queue):
    r = queue
    a, b = _scheduler(r, "a"), _scheduler(r, "b")
    _submit(r, "j1", 6)
    assert a.run_once() > 0 and a.ownership.held
    assert b.run_once() == 0 and not b.ownership.held  # standing by: reads and writes nothing
    while a.run_once():
        pass
    _submit(r, "j2", 6)
    assert b.run_once() == 0 and r.xlen(KEYS.requests) == 6  # j2 waits for the owner ...
    # ... which dies (its lease is no longer renewed): b takes over within the takeover time
    wait_until(lambda: b.run_once() > 0, timeout=5 * TAKEOVER_S, what="b to take over")
    while b.run_once():
        pass
    assert b.ownership.held and not a.run_once() and not a.ownership.held  # a came back: stands by
    assert r.get(KEYS.scheduler_owner).decode() == b.ownership.token
    assert _dispatched(r) == Counter({(job, i): 1 for job in ("j1", "j2") for i in range(6)})


def test_a_paused_owner_writes_nothing_after_the_takeover(queue):
    r = queue
    a, b = _scheduler(r, "a"), _scheduler(r, "b")
    _submit(r, "j", 8)
    assert a.intake.step(None) > 0  # a staged the requests, then is paused before dispatching
    staged = a.dispatcher.staging.count("tiny")
    time.sleep(TAKEOVER_S + 0.1)
    assert b.run_once() > 0  # b took over and dispatched them
    assert a.run_once() == 0  # a wakes up: its transaction is refused, it stands by
    assert not a.ownership.held and staged == 8
    assert _dispatched(r) == Counter({("j", i): 1 for i in range(8)})


def test_entries_read_by_a_scheduler_that_lost_the_ownership_mid_pass_are_taken_in(queue):
    r = queue
    a, b = _scheduler(r, "a"), _scheduler(r, "b")
    assert a.run_once() == 0 or a.ownership.held  # a owns the queue
    _submit(r, "j", 5)
    time.sleep(TAKEOVER_S + 0.1)  # a is paused ...
    assert b.ownership.tick()  # ... b takes over, and a wakes up in the middle of a pass:
    with pytest.raises(NotOwner):  # it read the entries (under the schedulers' shared name) ...
        a.intake.step(None)
    assert r.xpending(KEYS.requests, "scheduler")["pending"] == 5  # ... and could settle none
    wait_until(lambda: b.run_once() and _dispatched(r), timeout=5, what="b to find them")
    while b.run_once():
        pass
    assert _dispatched(r) == Counter({("j", i): 1 for i in range(5)})


LAPSE_S = 0.1


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(steps=st.lists(st.sampled_from(["a", "b", "lapse", "submit"]), min_size=4, max_size=20))
def test_interleaved_passes_of_two_schedulers_dispatch_every_request_once(queue, steps):
    """Two schedulers' passes in any order, the owner's lease lapsing at any point (a pause past the
    takeover time, during which nobody runs), new requests arriving: every request ends up in exactly
    one batch, whoever dispatched it, and one scheduler at most holds the ownership."""
    r = queue
    for key in r.scan_iter(f"{KEYS.prefix}:*"):  # hypothesis reuses the fixture: a clean queue
        if not key.startswith(f"{KEYS.prefix}:model".encode()) and b":worker" not in key:
            r.delete(key)
    scheds = {"a": _scheduler(r, "a", takeover=LAPSE_S), "b": _scheduler(r, "b", takeover=LAPSE_S)}
    jobs = []

    def submit() -> None:
        jobs.append(f"j{len(jobs) + 1}")
        _submit(r, jobs[-1], 3)

    interleave(steps, scheds, submit, LAPSE_S)
    holder = r.get(KEYS.scheduler_owner)
    assert holder is None or holder.decode() in {s.ownership.token for s in scheds.values()}
    assert _dispatched(r) == Counter({(job, i): 1 for job in jobs for i in range(3)})


def test_the_metrics_say_which_scheduler_owns(queue):
    from batchinfer.ops.metrics import SchedulerMetrics

    r = queue
    metrics = {name: SchedulerMetrics() for name in ("a", "b")}
    scheds = {name: SchedulerDaemon(r, Settings(prefix=KEYS.prefix, scheduler_takeover_seconds=TAKEOVER_S),
                                    instance=name, metrics=metrics[name]) for name in ("a", "b")}

    def sample(name: str, metric: str) -> float | None:
        return metrics[name].registry.get_sample_value(metric)

    scheds["a"].run_once()
    scheds["b"].run_once()
    assert sample("a", "batchinfer_scheduler_owner") == 1 and sample("b", "batchinfer_scheduler_owner") == 0
    assert sample("a", "batchinfer_scheduler_ownership_taken_total") == 1
    assert sample("b", "batchinfer_scheduler_ownership_taken_total") == 0
    scheds["a"].ownership.release()  # a stops cleanly: b takes over on its next look
    scheds["b"].run_once()
    assert sample("b", "batchinfer_scheduler_owner") == 1
    assert sample("b", "batchinfer_scheduler_ownership_taken_total") == 1


def test_running_schedulers_announce_themselves_and_top_shows_them(queue):
    import threading

    from batchinfer.cli.top import scheduler_text
    from batchinfer.store.ownership import live_schedulers

    r = queue
    assert scheduler_text(live_schedulers(r, KEYS.schedulers)).plain.startswith("no scheduler is running")
    stops = {name: threading.Event() for name in ("a", "b")}
    scheds = {name: _scheduler(r, name) for name in stops}
    threads = [threading.Thread(target=scheds[n].run, args=(stops[n],), daemon=True) for n in stops]
    for t in threads:
        t.start()
    try:
        def both() -> list | None:
            views = live_schedulers(r, KEYS.schedulers)
            return views if len(views) == 2 and views[0].owner else None

        views = wait_until(both, timeout=10, what="both schedulers announced")
        assert [v.owner for v in views] == [True, False]  # the owner first
        assert {v.token for v in views} == {s.ownership.token for s in scheds.values()}
        owner = next(s for s in scheds.values() if s.ownership.token == views[0].token)
        assert scheduler_text(views).plain == f"scheduler {owner.ownership.label} (+1 standing by)"
    finally:
        for event in stops.values():
            event.set()
        for t in threads:
            t.join(timeout=10)
    assert live_schedulers(r, KEYS.schedulers) == []  # a clean stop withdraws its announcement
    assert r.get(KEYS.scheduler_owner) is None  # and gives the ownership up


def test_a_silent_scheduler_is_not_live_and_is_forgotten_in_the_end(redis_server):
    from batchinfer.store.ownership import FORGET_AFTER_MS, live_schedulers

    r = redis_server.client()
    now = now_ms()
    for token, age in (("fresh:1:x", 0), ("silent:2:y", 5_000), ("gone:3:z", FORGET_AFTER_MS + 1)):
        r.hset(KEYS.schedulers, token, json.dumps({"owner": False, "heartbeat_at": now - age,
                                                    "takeover_seconds": 2}))
    r.hset(KEYS.schedulers, "junk:4:w", "not json")
    assert [v.token for v in live_schedulers(r, KEYS.schedulers)] == ["fresh:1:x"]
    assert sorted(k.decode() for k in r.hkeys(KEYS.schedulers)) == ["fresh:1:x", "silent:2:y"]


def test_a_stale_recovery_pass_blames_no_entry(queue):
    """Re-reading its pending entries one at a time, a scheduler that lost the ownership stops at
    the first refused transaction instead of taking that entry for one that fails (logged, re-read,
    and answered with an internal_error after five reads)."""
    r = queue
    a, b = _scheduler(r, "a"), _scheduler(r, "b")
    _submit(r, "j", 3)
    r.xgroup_create(KEYS.requests, "scheduler", id="0", mkstream=True)
    r.xreadgroup("scheduler", "scheduler", {KEYS.requests: ">"})  # read earlier, never settled
    assert b.ownership.tick()
    with pytest.raises(NotOwner):
        a.intake.step(None)  # a starts with a recovery pass: the first entry alone is refused
    assert r.xpending(KEYS.requests, "scheduler")["pending"] == 3 and not _dispatched(r)
    while b.run_once():
        pass
    assert _dispatched(r) == Counter({("j", i): 1 for i in range(3)})
