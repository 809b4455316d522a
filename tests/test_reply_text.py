"""Replies turned into text with ``as_text`` (issue 10): strict where a daemon owns the record,
``"replace"`` in read-only views; and the reply paths whose typing changed (the holding area,
the lag fallback of dispatch, chunked stream reads)."""

from __future__ import annotations

import json

import pytest

from batchinfer.config import Settings
from batchinfer.jobs.export import iter_stream
from batchinfer.keys import WORKERS_GROUP, Keys
from batchinfer.protocol.entries import IntakeEntry
from batchinfer.protocol.rows import ResultRow, now_ms
from batchinfer.scheduler.daemon import SchedulerDaemon
from batchinfer.scheduler.dispatch import undelivered
from batchinfer.scheduler.staging import held_key
from batchinfer.store.jobstore import JobRecord, JobStatus, parse_status
from batchinfer.store.queue_state import job_view
from batchinfer.store.registry import Registry
from batchinfer.workers.service.keeper import Keeper
from batchinfer.workers.text.tokenizer_files import read_tokenizer_files

KEYS = Keys("{rt}")
CAP = {"max_model_len": 128, "max_num_seqs": 4, "max_num_batched_tokens": 256, "kv_tokens": 4096}


def test_job_record_text_is_strict_and_views_replace() -> None:
    assert parse_status(b"\xffcancelled") is None  # not UTF-8: no status, and no crash
    assert parse_status(b"cancelled") is JobStatus.CANCELLED
    with pytest.raises(UnicodeDecodeError):
        JobRecord.from_hash({b"id": b"j", b"status": b"completed", b"model": b"\xff"})
    view = job_view("j", {b"status": b"in_progress", b"model": b"m\xff", b"total": b"3"})
    assert (view.status, view.model, view.total) == ("in_progress", "m\ufffd", 3)


def test_undelivered_counts_entries_when_redis_cannot_tell_the_lag(redis_server) -> None:
    r = redis_server.client()
    ids = [r.xadd("b", {"n": i}) for i in range(5)]
    r.xgroup_create("b", WORKERS_GROUP, id="0")
    r.xgroup_create("b", "other", id="0")
    r.xreadgroup(WORKERS_GROUP, "w", {"b": ">"}, count=1)
    assert undelivered(r, "b", cap=10) == 4  # Redis's own lag
    r.xdel("b", ids[3])  # a tombstone after the group's position: lag is nil
    assert [g["lag"] for g in r.xinfo_groups("b")] == [None, None]
    assert undelivered(r, "b", cap=10) == 3 and undelivered(r, "b", cap=2) == 2
    assert undelivered(r, "nothing", cap=10) == 0


def test_undelivered_is_exact_after_the_group_reads_past_a_deleted_entry(redis_server) -> None:
    """Redis 7.0 keeps counting an unread entry deleted before the group read past it (a cancelled
    job's batch no worker held): its lag stays 1 too high for good, which stopped dispatch (CI saw a
    model's staged requests never dispatched after such a cancel)."""
    r = redis_server.client()
    ids = [r.xadd("b", {"n": i}) for i in range(4)]
    r.xgroup_create("b", WORKERS_GROUP, id="0")
    r.xreadgroup(WORKERS_GROUP, "w", {"b": ">"}, count=1)
    r.xdel("b", ids[1])
    r.xreadgroup(WORKERS_GROUP, "w", {"b": ">"}, count=10)  # reads the two left, past the gap
    assert undelivered(r, "b", cap=10) == 0
    r.xadd("b", {"n": 4})
    assert undelivered(r, "b", cap=10) == 1
    r.xreadgroup(WORKERS_GROUP, "w", {"b": ">"}, count=10)
    assert undelivered(r, "b", cap=10) == 0


def test_iter_stream_reads_every_entry_in_chunks(redis_server) -> None:
    r = redis_server.client()
    ids = [r.xadd("res", {"row": str(i)}) for i in range(5)]
    got = list(iter_stream(r, "res", count=2))
    assert [eid for eid, _ in got] == ids and [f[b"row"] for _, f in got] == [b"0", b"1", b"2", b"3", b"4"]
    assert list(iter_stream(r, "res", count=2, start=ids[3].decode())) == got[3:]


def test_held_entry_keeps_its_fields_and_a_full_holding_area_rejects(redis_server, tiny_llama) -> None:
    r = redis_server.client()
    Registry(r, KEYS).register_model("tiny", read_tokenizer_files(tiny_llama), CAP)
    sched = SchedulerDaemon(r, Settings(prefix=KEYS.prefix), direct_hold_s=600.0)
    sched.intake.held_limit = 1
    entry = IntakeEntry(body=json.dumps({"prompt": "hi", "model": "later"})).to_fields()
    before = now_ms()
    first = r.xadd(KEYS.requests, entry)
    sched.run_once()
    ((held_id, fields),) = r.xrange(held_key(KEYS))
    until = int(fields[b"held_until"])
    assert before + 600_000 <= until <= now_ms() + 600_000
    assert fields == {**{k.encode(): v.encode() for k, v in entry.items()}, b"held_from": first,
                      b"held_until": str(until).encode(), b"held_model": b"later"}
    assert sched.intake.sweep_held() == 0 and r.xrange(held_key(KEYS)) == [(held_id, fields)]

    r.xadd(KEYS.requests, IntakeEntry(body=json.dumps({"prompt": "ho", "model": "later"}),
                                      reply_to="{rt}:reply:x").to_fields())
    sched.run_once()
    assert r.xlen(held_key(KEYS)) == 1  # the area is full: the second entry is answered at once
    ((_, reply),) = r.xrange("{rt}:reply:x")
    row = ResultRow.from_json(reply[b"row"])
    assert (row.error_code, row.error_message) == (
        "unknown_model", "model 'later' is not served by any worker (and the holding area for unknown "
                         "models is full)")


def test_keeper_refresh_keeps_its_own_leases_and_reports_the_taken_one(redis_server) -> None:
    r = redis_server.client()
    stream = KEYS.batches("m")
    ids = [r.xadd(stream, {"n": i}).decode() for i in range(2)]
    r.xgroup_create(stream, WORKERS_GROUP, id="0")
    r.xreadgroup(WORKERS_GROUP, "w1", {stream: ">"})
    keeper = Keeper(r, KEYS, worker="w1", model="m", lease_seconds=30, heartbeat_seconds=10,
                    status=lambda: {"model": "m"})
    for entry_id in ids:
        keeper.hold(entry_id)
    r.xclaim(stream, WORKERS_GROUP, "scheduler", 0, [ids[1]])  # taken over meanwhile
    keeper.refresh()
    assert keeper.take_lost() == [ids[1]]
    keeper.refresh()
    assert keeper.take_lost() == []  # the kept one is still this worker's
    assert r.xpending_range(stream, WORKERS_GROUP, "-", "+", 10, consumername="w1")[0]["message_id"] == \
        ids[0].encode()
