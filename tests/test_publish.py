"""Exactly-once publication, finish_submission transitions, and the model / worker registry."""

from __future__ import annotations

import logging
import threading
import time
import uuid

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batchinfer.keys import Keys
from batchinfer.ops.metrics import SchedulerMetrics
from batchinfer.protocol.rows import ResultRow
from batchinfer.store.publish import Publisher, RowsFailed
from batchinfer.store.registry import Registry

KEYS = Keys("{t}")


@pytest.fixture
def r(redis_server):
    return redis_server.client()


def make_job(r, job_id: str, status: str = "validating") -> None:
    r.hset(KEYS.job(job_id), mapping={"id": job_id, "status": status, "completed": 0, "failed": 0})


def row(job_id: str | None, idx: int | None, status: str = "completed", request_id: str | None = None):
    if status == "completed":
        return ResultRow(job_id=job_id, idx=idx, request_id=request_id or f"{job_id}:{idx}", status=status,
                         output_text="hi")
    return ResultRow.error("boom", "it broke", status=status, job_id=job_id, idx=idx, request_id=request_id)


def job_fields(r, job_id: str) -> dict[str, str]:
    return {k.decode(): v.decode() for k, v in r.hgetall(KEYS.job(job_id)).items()}


def test_publish_once_under_concurrency(r):
    make_job(r, "j1", "in_progress")
    r.hset(KEYS.job("j1"), "total", 1)
    outcomes = []
    barrier = threading.Barrier(8)

    def worker():
        pub = Publisher(r, KEYS)
        barrier.wait()
        outcomes.append(pub.publish(row("j1", 0)))

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(o.published for o in outcomes) == 1
    assert sum(o.finalizing for o in outcomes) == 1
    assert r.xlen(KEYS.results("j1")) == 1
    fields = job_fields(r, "j1")
    assert fields["completed"] == "1" and fields["failed"] == "0"
    assert fields["status"] == "finalizing" and "finalizing_at" in fields
    assert Publisher(r, KEYS).is_published("j1", 0)


def test_counters_reply_to_and_row_content(r):
    make_job(r, "j2", "in_progress")
    pub = Publisher(r, KEYS)
    assert pub.publish(row("j2", 0), reply_to="{t}:reply:a").published
    assert pub.publish(row("j2", 1, "failed")).published
    assert pub.publish(row("j2", 2, "cancelled")).published
    assert not pub.publish(row("j2", 1, "completed")).published  # a late duplicate changes nothing
    fields = job_fields(r, "j2")
    # each row status has its own counter: a cancelled row is not a failure
    assert (fields["completed"], fields["failed"], fields["cancelled"]) == ("1", "1", "1")
    assert "expired" not in fields
    assert fields["status"] == "in_progress"  # no total yet: submission has not ended
    (_, reply), = r.xrange("{t}:reply:a")
    assert ResultRow.from_json(reply[b"row"]).output_text == "hi"
    assert 0 < r.ttl("{t}:reply:a") <= pub.direct_guard_ttl  # an abandoned reply stream expires
    rows = [ResultRow.from_json(f[b"row"]) for _, f in r.xrange(KEYS.results("j2"))]
    assert [(x.idx, x.status) for x in rows] == [(0, "completed"), (1, "failed"), (2, "cancelled")]
    assert pub.published_mask([("j2", 0, None), ("j2", 3, None), ("j2", 2, None)]) == [True, False, True]


def test_direct_request_guarded_by_request_id(r):
    pub = Publisher(r, KEYS)
    first = pub.publish(row(None, None, request_id="1-0"), reply_to="{t}:reply:b")
    again = pub.publish(row(None, None, request_id="1-0"), reply_to="{t}:reply:b")
    assert first.published and not again.published and not first.finalizing
    assert r.xlen(KEYS.results("direct")) == 1 and r.xlen("{t}:reply:b") == 1
    assert 0 < r.ttl(KEYS.published_direct("1-0")) <= pub.direct_guard_ttl
    assert pub.is_published(None, None, "1-0") and not pub.is_published(None, None, "2-0")


def test_finish_submission_before_and_after_rows(r):
    pub = Publisher(r, KEYS)
    make_job(r, "a")
    pub.publish(row("a", 0))
    assert not pub.finish_submission("a", 2)  # one row still owed
    assert job_fields(r, "a")["status"] == "in_progress"
    assert pub.publish(row("a", 1, "failed")).finalizing
    assert job_fields(r, "a")["status"] == "finalizing"

    make_job(r, "b")
    pub.publish(row("b", 0))
    pub.publish(row("b", 1))
    assert pub.finish_submission("b", 2)  # every row already there: this call finalizes
    assert job_fields(r, "b")["status"] == "finalizing"
    assert not pub.finish_submission("b", 2)  # only once

    make_job(r, "empty")
    assert pub.finish_submission("empty", 0)
    with pytest.raises(KeyError, match="nope"):
        pub.finish_submission("nope", 1)


def test_cancelling_job_keeps_status_but_still_requests_export(r):
    pub = Publisher(r, KEYS)
    make_job(r, "c", "cancelling")
    assert not pub.finish_submission("c", 1)
    assert job_fields(r, "c")["status"] == "cancelling"
    assert pub.publish(row("c", 0, "cancelled")).finalizing
    fields = job_fields(r, "c")
    assert fields["status"] == "cancelling" and "export_requested_at" in fields
    # the row itself is stored and counted as a cancelled one, and its guard bit is set
    ((_, entry),) = r.xrange(KEYS.results("c"))
    stored = ResultRow.from_json(entry[b"row"])
    assert (stored.request_id, stored.idx, stored.status) == ("c:0", 0, "cancelled")
    assert stored.error_code == "boom"
    assert fields["cancelled"] == "1" and fields["failed"] == "0" and pub.is_published("c", 0)


def test_publish_survives_script_flush(redis_server):
    r = redis_server.client()
    make_job(r, "f", "in_progress")
    pub = Publisher(r, KEYS)
    assert pub.publish(row("f", 0)).published
    r.script_flush()  # as after a Redis restart: EVALSHA misses, the script is loaded again
    assert pub.publish(row("f", 1)).published


def test_a_row_of_a_job_with_no_record_is_dropped_and_counted(r, caplog):
    """As after a Redis restart without persistence: the job's record is gone while its requests are
    still in flight. Their rows write nothing (no orphan results stream with no TTL), are counted,
    and one warning names the job."""
    make_job(r, "gone", "in_progress")
    metrics = SchedulerMetrics()
    pub = Publisher(r, KEYS, metrics=metrics)
    assert pub.publish(row("gone", 0)).published
    r.delete(KEYS.job("gone"), KEYS.results("gone"), KEYS.published("gone"))  # what the restart lost
    before = set(r.keys("*"))
    with caplog.at_level(logging.WARNING, logger="batchinfer.store.publish"):
        outcome = pub.publish(row("gone", 1), reply_to="{t}:reply:gone")
        assert (outcome.published, outcome.finalizing, outcome.dropped) == (False, False, True)
        assert set(r.keys("*")) == before  # no results stream, guard, record or reply stream
        assert not r.exists(KEYS.results("gone"))
        assert metrics.registry.get_sample_value("batchinfer_rows_dropped_total", {"reason": "no_job"}) == 1
        again = pub.publish_many([(row("gone", 2, "failed"), None), (row("gone", 1), None)])
        assert [o.dropped for o in again] == [True, True]
    assert set(r.keys("*")) == before
    assert metrics.registry.get_sample_value("batchinfer_rows_dropped_total", {"reason": "no_job"}) == 3
    warnings = [m for m in caplog.messages if "gone" in m]
    assert len(warnings) == 1 and "no record" in warnings[0]  # once per job, not once per row
    # a live job's rows in the same call are published as ever; direct requests need no job record
    make_job(r, "live", "in_progress")
    direct = row(None, None, request_id="9-0")
    mixed = pub.publish_many([(row("live", 0), None), (row("gone", 3), None), (direct, None)])
    assert [(o.published, o.dropped) for o in mixed] == [(True, False), (False, True), (True, False)]
    assert r.xlen(KEYS.results("live")) == 1 and r.xlen(KEYS.results("direct")) == 1


def test_registry_models_and_workers(r):
    reg = Registry(r, KEYS)
    assert reg.get_model("m") is None and reg.models() == []
    cap = {"max_model_len": 256, "max_num_seqs": 8, "max_num_batched_tokens": 512, "kv_tokens": 4096}
    reg.register_model("m", {"tokenizer.json": b"{}", "tokenizer_config.json": b'{"a": 1}'}, cap, [2])
    info = reg.get_model("m")
    assert info.capacity == cap and info.eos_token_ids == [2]
    assert info.files["tokenizer_config.json"] == b'{"a": 1}'
    assert reg.models() == ["m"] and reg.model_fingerprint("m") == info.fingerprint
    reg.register_model("m", {"tokenizer.json": b'{"v": 2}'}, cap)
    assert reg.get_model("m").fingerprint != info.fingerprint
    assert "tokenizer_config.json" not in reg.get_model("m").files
    with pytest.raises(ValueError, match="kv_tokens"):
        reg.register_model("x", {"tokenizer.json": b"{}"}, {"max_model_len": 1})

    before = time.time_ns() // 1_000_000
    reg.heartbeat_worker("w1", {"model": "m", "device": "cpu", "capacity": cap}, ttl=30)
    after = time.time_ns() // 1_000_000
    reg.heartbeat_worker("w2", {"model": "other"}, ttl=0.05)
    assert [w.name for w in reg.live_workers()] == ["w1", "w2"]
    (w1,) = reg.live_workers("m")
    assert w1.info["device"] == "cpu" and w1.capacity == cap and before <= w1.heartbeat_at <= after
    deadline = time.monotonic() + 5
    while r.exists(KEYS.worker("w2")) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert [w.name for w in reg.live_workers()] == ["w1"]
    assert r.zrange(KEYS.workers, 0, -1) == [b"w1"]  # the expired name was pruned
    reg.unregister_worker("w1")
    assert reg.live_workers() == []


def test_publish_many_matches_publish_in_order_with_repeats(r):
    make_job(r, "m", "in_progress")
    pub = Publisher(r, KEYS)
    items = [(row("m", 0), "{t}:reply:m"), (row("m", 1, "failed"), None), (row("m", 0), "{t}:reply:m"),
             (row("m", 2), None)]
    outcomes = pub.publish_many(items)
    assert [o.published for o in outcomes] == [True, True, False, True]  # the repeat within one call
    assert pub.finish_submission("m", 4) is False  # idx 3 is still owed
    again = pub.publish_many([(row("m", 2), None), (row("m", 3), None), (row("m", 3), None)])
    assert [(o.published, o.finalizing) for o in again] == [(False, False), (True, True), (False, False)]
    rows = [ResultRow.from_json(f[b"row"]) for _, f in r.xrange(KEYS.results("m"))]
    assert sorted(x.idx for x in rows) == [0, 1, 2, 3]
    assert r.xlen("{t}:reply:m") == 1
    fields = job_fields(r, "m")
    assert (fields["completed"], fields["failed"], fields["status"]) == ("3", "1", "finalizing")
    assert pub.publish_many([]) == []


def test_publish_many_reloads_the_script_and_keeps_outcomes(redis_server):
    r = redis_server.client()
    make_job(r, "n", "in_progress")
    r.hset(KEYS.job("n"), "total", 2)
    pub = Publisher(r, KEYS)
    assert pub.publish(row("n", 0)).published
    r.script_flush()  # as after a Redis restart: every EVALSHA of the pipeline gets NOSCRIPT
    outcomes = pub.publish_many([(row("n", 1), None), (row("n", 0), None)])
    assert [(o.published, o.finalizing) for o in outcomes] == [(True, True), (False, False)]
    assert r.xlen(KEYS.results("n")) == 2
    with pytest.raises(ValueError, match="idx"):
        pub.publish_many([(row("n", -1), None)])


def test_publish_many_a_failing_row_fails_alone_and_the_call_raises_after_the_others(r):
    """One row's error (WRONGTYPE on its guard) inside a publish_rows.lua call: the rows before and
    after it in the same call are published; the call raises RowsFailed, naming the request and
    carrying the others' outcomes, so the export of the job they made final is enqueued at once;
    a retry publishes what is left once the key is mended."""
    from batchinfer.jobs.queueing import publish_then_export

    for job in ("ok", "bad"):
        make_job(r, job, "in_progress")
        r.hset(KEYS.job(job), "total", 1 if job == "bad" else 2)
    r.hset(KEYS.published("bad"), "not", "a bitmap")
    pub = Publisher(r, KEYS)
    items = [(row("ok", 0), None), (row("bad", 0), None), (row("ok", 1), None)]
    exports: list[str] = []
    with pytest.raises(RowsFailed, match=r"1 row\(s\) failed, the first of request bad:0: WRONGTYPE") as err:
        publish_then_export(pub, items, exports.append)
    assert isinstance(err.value, redis.ResponseError)  # callers retry it as any Redis error
    assert [(o.published, o.finalizing) if o else None for o in err.value.outcomes] == [
        (True, False), None, (True, True)]
    assert exports == ["ok"]
    assert r.xlen(KEYS.results("ok")) == 2  # both good rows, the second after the failed one
    assert job_fields(r, "ok")["status"] == "finalizing"
    assert not r.exists(KEYS.results("bad"))
    r.delete(KEYS.published("bad"))
    outcomes = pub.publish_many(items)
    assert [(o.published, o.finalizing) for o in outcomes] == [(False, False), (True, True), (False, False)]


def test_publish_many_splits_calls_by_partition_and_chunk(redis_server, monkeypatch):
    """More rows than one call takes, over two partitions: one call per partition and chunk (a
    Cluster needs one slot per call), every row published once, outcomes in the caller's order."""
    from batchinfer.store import publish

    monkeypatch.setattr(publish, "PUBLISH_CHUNK", 3)
    keys = Keys("{q}", partitions=2)
    r = redis_server.client()
    names = [f"job{i}" for i in range(40)]
    jobs = [next(j for j in names if keys.job_partition(j) == p) for p in (0, 1)]
    for job in jobs:
        r.hset(keys.job(job), mapping={"id": job, "status": "in_progress", "total": 5})
    assert keys.published(jobs[0]).startswith("{q}:") and keys.published(jobs[1]).startswith("{q.1}:")
    items = [(row(jobs[i % 2], i // 2), None) for i in range(10)]  # the jobs' rows interleaved
    chunks = publish._chunks(list(range(10)), [([keys.published(x.job_id)], []) for x, _ in items])
    assert chunks == [[0, 2, 4], [6, 8], [1, 3, 5], [7, 9]]
    outcomes = Publisher(r, keys).publish_many(items)
    assert [o.published for o in outcomes] == [True] * 10
    assert [i for i, o in enumerate(outcomes) if o.finalizing] == [8, 9]  # each job's last row
    for job in jobs:
        assert sorted(ResultRow.from_json(f[b"row"]).idx for _, f in r.xrange(keys.results(job))) == \
            list(range(5))


@given(published=st.sets(st.integers(0, 40)), asked=st.lists(st.integers(0, 48), max_size=20),
       direct=st.lists(st.booleans(), max_size=4), span=st.sampled_from([1, 2, 65536]))
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_published_mask_reads_each_guard_bit(r, monkeypatch, published, asked, direct, span):
    """published_mask against GETBIT, whatever the idx (GETRANGE of the span, or a GETBIT each past
    GUARD_SPAN_BYTES), in the caller's order, with direct requests among the job's."""
    from batchinfer.store import publish

    monkeypatch.setattr(publish, "GUARD_SPAN_BYTES", span)
    job = f"g{uuid.uuid4().hex[:8]}"
    make_job(r, job, "in_progress")
    pub = Publisher(r, KEYS)
    if published:
        pub.publish_many([(row(job, idx), None) for idx in published])
    triples = [(job, idx, None) for idx in asked]
    for i, done in enumerate(direct):
        rid = f"{job}-{i}"
        if done:
            pub.publish(ResultRow(job_id=None, request_id=rid, status="completed", output_text="d"))
        triples.insert(i * 3, (None, None, rid))
    want = [bool(r.getbit(KEYS.published(j), i)) if j else bool(r.exists(KEYS.published_direct(rid)))
            for j, i, rid in triples]
    assert pub.published_mask(triples) == want
    assert [want[n] for n, (j, _, _) in enumerate(triples) if j] == [idx in published for idx in asked]


@given(batches=st.lists(st.lists(st.tuples(st.integers(0, 11), st.booleans()), max_size=12), max_size=6))
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_publish_many_is_exactly_once_across_calls(r, batches):
    """Whatever the repeats within and across calls: one row per idx, counters match, one finalizer."""
    job = f"h{uuid.uuid4().hex[:8]}"
    make_job(r, job, "in_progress")
    pub = Publisher(r, KEYS)
    pub.finish_submission(job, 12)
    published, finalizers = set(), 0
    for batch in batches:
        outcomes = pub.publish_many([(row(job, idx, "completed" if ok else "failed"), None)
                                     for idx, ok in batch])
        for (idx, _), outcome in zip(batch, outcomes, strict=True):
            assert outcome.published == (idx not in published)
            published.add(idx)
            finalizers += outcome.finalizing
    rows = [ResultRow.from_json(f[b"row"]) for _, f in r.xrange(KEYS.results(job))]
    assert sorted(x.idx for x in rows) == sorted(published)
    fields = job_fields(r, job)
    assert int(fields["completed"]) + int(fields["failed"]) == len(published)
    assert finalizers == (1 if len(published) == 12 else 0)


def test_publish_rows_names_each_key_once_and_a_malformed_row_spec_fails_alone(r):
    """A publish_rows.lua call carries every distinct key once (a job's guard, results stream and job
    hash serve all of its rows) and two values a row; a spec the script cannot read fails its row
    alone, with the spec in the error."""
    from batchinfer.store import publish

    make_job(r, "k", "in_progress")
    pub = Publisher(r, KEYS)
    items = [(row("k", i), "{t}:reply" if i == 1 else None) for i in range(3)]
    job_keys: dict = {}
    calls = [pub._call(x, reply_to, job_keys) for x, reply_to in items]
    keys, args = publish._packed([0, 1, 2], calls, [1, 2, 3])
    assert keys == [KEYS.published("k"), KEYS.results("k"), KEYS.job("k"), KEYS.redelivery("k:0", "k"),
                    KEYS.redelivery("k:1", "k"), "{t}:reply", KEYS.redelivery("k:2", "k")]
    assert args[3::2] == ["0 completed 1 2 3 4", "1 completed 1 2 3 5 6", "2 completed 1 2 3 7"]
    args[5] = "1 completed one 2 3 5"  # the second row's spec, unreadable
    codes, skipped, errors = pub._publish_rows(keys=keys, args=args)
    assert codes == b"1e1" and skipped == []
    assert errors[0] == 2 and b"malformed row spec: 1 completed one" in errors[1]
    assert sorted(ResultRow.from_json(f[b"row"]).idx for _, f in r.xrange(KEYS.results("k"))) == [0, 2]
