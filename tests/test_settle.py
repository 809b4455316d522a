"""A cancelled or expired job is settled at once where no live worker holds its requests (staging,
the holding area, batches nobody claimed or whose consumer is gone), and only there: a batch a live
worker holds is left to it. Real redis-server, real scheduler passes (issue 28, item 1)."""

from __future__ import annotations

import json

import pytest
from clocks import FakeClock
from test_scheduler import CAP, KEYS, batches, live_worker, make_scheduler, run_until_idle, submit

from batchinfer.jobs.export import export_job
from batchinfer.keys import WORKERS_GROUP
from batchinfer.protocol.batches import encode
from batchinfer.protocol.entries import IntakeEntry
from batchinfer.protocol.rows import BatchRequest, ResultRow
from batchinfer.redis_conn import ensure_group
from batchinfer.scheduler.accounting import BatchView, JobState, Settlement, ended_jobs, held_of, plan_batches
from batchinfer.scheduler.staging import Staging, held_key
from batchinfer.store import scripts
from batchinfer.store.jobstore import JobStatus, JobStore
from batchinfer.store.publish import Publisher
from batchinfer.store.registry import Registry
from batchinfer.workers.text.tokenizer_files import read_tokenizer_files

N = 12  # 2 batches of 4 (max_num_seqs) for one live worker, 4 left staged


@pytest.fixture
def env(redis_server, tiny_llama):
    r = redis_server.client()
    registry = Registry(r, KEYS)
    registry.register_model("tiny", read_tokenizer_files(tiny_llama), CAP)
    return r, registry


def dispatched_job(r, registry, job="j", clock=None, wall=None):
    """A job of N requests: 2 batches dispatched while worker w1 lived, the rest staged; w1 gone."""
    clock = clock or FakeClock()
    sched = make_scheduler(r, clock=clock, wall=wall)
    live_worker(registry)
    JobStore(r, KEYS).create(job, model="tiny")
    submit(r, job, [{"prompt": f"p{i}", "max_tokens": 4} for i in range(N)])
    Publisher(r, KEYS).finish_submission(job, N)
    run_until_idle(sched)
    assert [len(b) for b in batches(r)] == [4, 4] and Staging(r, KEYS).count("tiny") == 4
    return sched, clock


def statuses(r, job):
    """idx -> status of every row of ``job``, checking there is one row per request."""
    got = [ResultRow.from_json(f[b"row"]) for _, f in r.xrange(KEYS.results(job))]
    idxs = [row.idx for row in got]
    assert len(idxs) == len(set(idxs)), f"two rows for one request: {sorted(idxs)}"
    return {row.idx: row.status for row in got}


def test_a_cancel_without_a_live_worker_settles_staging_and_unclaimed_batches(env, tmp_path, redis_server):
    r, registry = env
    sched, clock = dispatched_job(r, registry)
    registry.unregister_worker("w1")  # the model's only worker is gone: nothing will read the batches
    store = JobStore(r, KEYS)
    assert store.cancel("j") == JobStatus.CANCELLING
    clock.advance(1.0)  # the next accounting pass: no waiting for a lease or a worker
    run_until_idle(sched)
    assert statuses(r, "j") == dict.fromkeys(range(N), "cancelled")
    record = store.get("j")
    assert (record.cancelled, record.completed, record.failed) == (N, 0, 0)
    assert record.status == JobStatus.CANCELLING and r.hexists(KEYS.job("j"), "export_requested_at")
    assert r.xlen(KEYS.batches("tiny")) == 0 and Staging(r, KEYS).count("tiny") == 0
    from rq.job import Job

    from batchinfer.jobs.queueing import rq_job_id

    assert Job.exists(rq_job_id("export", KEYS.prefix, "j"), connection=r)  # the exporter ends it
    export_job("j", prefix=KEYS.prefix, output=str(tmp_path / "j.parquet"), redis_url=redis_server.url)
    assert store.get("j").status == JobStatus.CANCELLED
    clock.advance(1.0)
    assert sched.run_once() == 0  # nothing more to settle: no row is published twice


def test_a_batch_a_live_worker_holds_is_left_to_it_and_a_gone_consumers_is_settled(env):
    r, registry = env
    sched, clock = dispatched_job(r, registry)
    stream = KEYS.batches("tiny")
    [(_, [(held_id, fields)])] = r.xreadgroup(WORKERS_GROUP, "w1", {stream: ">"}, count=1)  # w1 runs it
    held = [q.idx for q in map(BatchRequest.from_dict, json.loads(fields[b"requests"]))]
    [(_, [(orphan_id, fields)])] = r.xreadgroup(WORKERS_GROUP, "w2", {stream: ">"}, count=1)
    orphaned = [q.idx for q in map(BatchRequest.from_dict, json.loads(fields[b"requests"]))]
    # w2 took the second batch and died (never registered: not a live worker); w1 is alive
    JobStore(r, KEYS).cancel("j")
    clock.advance(1.0)
    run_until_idle(sched)
    got = statuses(r, "j")
    assert set(got) == set(range(N)) - set(held)  # staged and w2's batch: settled without its lease
    assert set(got.values()) == {"cancelled"}
    assert [as_id for as_id, _ in r.xrange(stream)] == [held_id]  # w2's entry acked and deleted
    assert not r.xrange(stream, min=orphan_id, max=orphan_id) and orphaned
    [pending] = r.xpending_range(stream, WORKERS_GROUP, min="-", max="+", count=10)
    assert (pending["message_id"], pending["consumer"]) == (held_id, b"w1")  # still w1's
    # w1 aborts its requests (docs/worker.md) and acks: the job's last rows
    publisher = Publisher(r, KEYS)
    for idx in held:
        publisher.publish(ResultRow.error("cancelled", "aborted", status="cancelled", job_id="j", idx=idx,
                                          request_id=f"j:{idx}"))
    record = JobStore(r, KEYS).get("j")
    assert record.cancelled == N and r.hexists(KEYS.job("j"), "export_requested_at")


def test_expiry_settles_what_no_worker_holds(env):
    r, registry = env
    wall = FakeClock.from_now()
    sched, clock = dispatched_job(r, registry, wall=wall)
    registry.unregister_worker("w1")
    wall.advance(25 * 3600)  # past the default 24 h window
    clock.advance(1.0)
    run_until_idle(sched)
    assert statuses(r, "j") == dict.fromkeys(range(N), "expired")
    record = JobStore(r, KEYS).get("j")
    assert record.status == JobStatus.EXPIRED and record.expired == N
    assert r.hexists(KEYS.job("j"), "export_requested_at")
    assert r.xlen(KEYS.batches("tiny")) == 0 and Staging(r, KEYS).count("tiny") == 0


def test_held_requests_of_a_cancelled_job_are_settled_without_waiting_for_the_sweep(env):
    # 1,000 requests of another job are held ahead of this one's: the 2-s sweep (500 a time) would
    # reach them in turns; the cancel answers them at the next accounting pass.
    r, registry = env
    clock = FakeClock()
    sched = make_scheduler(r, clock=clock)
    store = JobStore(r, KEYS)
    for job, n in (("other", 1000), ("j", 3)):
        store.create(job, model="later")  # no worker has registered "later"
        pipe = r.pipeline()
        for i in range(n):
            pipe.xadd(KEYS.requests, IntakeEntry(body='{"prompt": "x"}', job_id=job, idx=i).to_fields())
        pipe.execute()
    run_until_idle(sched, passes=50)
    assert r.xlen(held_key(KEYS)) == 1003 and store.get("j").held == 3
    store.cancel("j")
    clock.advance(1.0)  # the accounting timer, not the held sweep's (2 s)
    run_until_idle(sched)
    assert statuses(r, "j") == dict.fromkeys(range(3), "cancelled")
    assert store.get("j").held == 0 and r.hget(KEYS.held_models, "later") == b"1000"
    assert r.xlen(held_key(KEYS)) == 1000 and store.get("other").held == 1000


def test_a_worker_claiming_a_batch_while_it_is_settled_gets_it_and_no_row_is_doubled(env):
    r, registry = env
    sched, clock = dispatched_job(r, registry)
    stream, drop, claimed = KEYS.batches("tiny"), sched.settler._drop, []

    def worker_first(keys, args):  # a worker reads the batch between the rows and the removal
        claimed.append(r.xreadgroup(WORKERS_GROUP, "w1", {stream: ">"}, count=1))
        return drop(keys=keys, args=args)

    sched.settler._drop = worker_first
    JobStore(r, KEYS).cancel("j")
    clock.advance(1.0)
    run_until_idle(sched)
    assert statuses(r, "j") == dict.fromkeys(range(N), "cancelled")
    assert r.xlen(stream) == 2  # both taken by w1 before their removal: left to it
    assert r.xpending(stream, WORKERS_GROUP)["pending"] == 2
    publisher = Publisher(r, KEYS)
    for [(_, [(_, fields)])] in claimed:  # w1 finds them published; a row it writes anyway is dropped
        for req in map(BatchRequest.from_dict, json.loads(fields[b"requests"])):
            assert publisher.published_mask([(req.job_id, req.idx, req.request_id)]) == [True]
            assert not publisher.publish(ResultRow(job_id="j", idx=req.idx, request_id=req.request_id,
                                                   status="completed")).published
    record = JobStore(r, KEYS).get("j")
    assert (record.cancelled, record.completed) == (N, 0) and r.xlen(KEYS.results("j")) == N


def test_removal_refuses_a_batch_a_worker_claimed_meanwhile(env):
    # The settler publishes the rows, then removes the entry only if nobody claimed it since.
    r, _ = env
    stream = KEYS.batches("tiny")
    drop = scripts.register(r, "drop_unclaimed_batch")
    request = q("j", 0)
    assert drop(keys=[stream], args=[WORKERS_GROUP, "1-0", ""]) == 0  # no stream at all
    fresh = r.xadd(stream, encode([request])).decode()
    assert drop(keys=[stream], args=[WORKERS_GROUP, fresh, ""]) == 1  # no group: nobody read it
    ensure_group(r, stream, WORKERS_GROUP)
    first, second = (r.xadd(stream, encode([request])).decode() for _ in range(2))
    r.xreadgroup(WORKERS_GROUP, "w1", {stream: ">"}, count=1)  # claimed after the settler looked
    assert drop(keys=[stream], args=[WORKERS_GROUP, first, ""]) == 0
    assert drop(keys=[stream], args=[WORKERS_GROUP, first, "w9"]) == 0  # pending for another consumer
    assert drop(keys=[stream], args=[WORKERS_GROUP, second, ""]) == 1  # still unclaimed
    assert drop(keys=[stream], args=[WORKERS_GROUP, first, "w1"]) == 1  # its consumer as seen: gone
    assert r.xlen(stream) == 0 and r.xpending(stream, WORKERS_GROUP)["pending"] == 0
    third = r.xadd(stream, encode([request])).decode()
    r.xreadgroup(WORKERS_GROUP, "w1", {stream: ">"}, count=1)
    r.xack(stream, WORKERS_GROUP, third)  # delivered and acked, its XDEL on the way: not ours
    assert drop(keys=[stream], args=[WORKERS_GROUP, third, ""]) == 0


def q(job, idx):
    return BatchRequest(request_id=f"{job}:{idx}", job_id=job, idx=idx, prompt_token_ids=[1],
                        sampling_params={}, model="tiny")


def test_the_policy_settles_only_what_no_live_worker_holds():
    ended = ended_jobs({"c": JobState(JobStatus.CANCELLING, False), "e": JobState(JobStatus.EXPIRED, False),
                        "done": JobState(JobStatus.CANCELLING, True), "gone": JobState(None, False),
                        "r": JobState(JobStatus.IN_PROGRESS, False)})
    assert ended == {"c": "cancelled", "e": "expired"}
    views = [BatchView("1-0", (q("c", 0), q("e", 1))),  # unclaimed, all ended: rows, then removed
             BatchView("2-0", (q("c", 2), q("r", 0))),  # mixed: rows, the entry stays for "r"
             BatchView("3-0", (q("c", 3),), owner="w1"),  # a live worker holds it
             BatchView("4-0", (q("c", 4),), owner="dead"),  # its consumer is gone
             BatchView("5-0", (q("c", 5),), whole=False),  # malformed elements: never removed here
             BatchView("6-0", (q("r", 1),))]  # nothing ended
    plans = {p.entry_id: p for p in plan_batches(views, {"w1"}, ended)}
    assert plans == {
        "1-0": Settlement("1-0", None, ((q("c", 0), "cancelled"), (q("e", 1), "expired")), remove=True),
        "2-0": Settlement("2-0", None, ((q("c", 2), "cancelled"),), remove=False),
        "4-0": Settlement("4-0", "dead", ((q("c", 4), "cancelled"),), remove=True),
        "5-0": Settlement("5-0", None, ((q("c", 5), "cancelled"),), remove=False)}
    entries = [(b"1-0", {b"job": b"c"}), (b"2-0", {b"job": b"r"}), (b"3-0", {})]
    assert held_of(entries, ["c"]) == [(b"1-0", {b"job": b"c"})]
