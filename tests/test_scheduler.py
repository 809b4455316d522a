"""The scheduler daemon against a real redis-server and the tiny model's tokenizer."""

from __future__ import annotations

import json
import threading
import time

import pytest
from clocks import FakeClock
from daemons import wait_until

from batchinfer.config import Settings
from batchinfer.keys import SCHEDULER_GROUP, WORKERS_GROUP, Keys
from batchinfer.protocol.batches import encode, retry_batches
from batchinfer.protocol.entries import IntakeEntry
from batchinfer.protocol.rows import BatchRequest, ResultRow
from batchinfer.redis_conn import ensure_group
from batchinfer.scheduler.daemon import SchedulerDaemon
from batchinfer.scheduler.staging import held_key
from batchinfer.store.jobstore import JobStore
from batchinfer.store.publish import Publisher
from batchinfer.store.registry import Registry
from batchinfer.workers.sampling_params import SamplingParams
from batchinfer.workers.text.tokenizer import Tokenizer
from batchinfer.workers.text.tokenizer_files import read_tokenizer_files

KEYS = Keys("{t}")
# A lease's idle time is Redis's own clock (XAUTOCLAIM's min-idle), which no fake clock moves: the
# lease tests use a lease this short and poll the reclaim until it takes the batch back.
LEASE_S = 0.05
CAP = {"max_model_len": 128, "max_num_seqs": 4, "max_num_batched_tokens": 256, "kv_tokens": 4096}


@pytest.fixture
def env(redis_server, tiny_llama):
    r = redis_server.client()
    registry = Registry(r, KEYS)
    registry.register_model("tiny", read_tokenizer_files(tiny_llama), CAP)
    return r, registry, Tokenizer.from_dir(tiny_llama)


def make_scheduler(r, hold: float = 600.0, clock: FakeClock | None = None, wall: FakeClock | None = None,
                   **settings) -> SchedulerDaemon:
    clocks = {**({"clock": clock} if clock else {}), **({"wall_clock": wall.ms} if wall else {})}
    sched = SchedulerDaemon(r, Settings(prefix="{t}", **settings), direct_hold_s=hold, **clocks)
    sched.dispatcher.jobs.ttl = sched.admission.jobs.ttl = 0  # see job changes at once
    return sched


def live_worker(registry, name="w1"):
    registry.heartbeat_worker(name, {"model": "tiny", "capacity": CAP}, ttl=60)


def submit(r, job, bodies, start=0):
    for i, body in enumerate(bodies, start):
        text = body if isinstance(body, str) else json.dumps(body)
        r.xadd(KEYS.requests, IntakeEntry(body=text, job_id=job, idx=i, line=i + 1).to_fields())


def batches(r, model="tiny"):
    return [[BatchRequest.from_dict(q) for q in json.loads(f[b"requests"])]
            for _, f in r.xrange(KEYS.batches(model))]


def rows(r, job):
    return {row.idx: row for row in (ResultRow.from_json(f[b"row"]) for _, f in r.xrange(KEYS.results(job)))}


def run_until_idle(sched, passes=20):
    for _ in range(passes):
        if sched.run_once() == 0:
            return


def test_valid_entries_become_tokenised_batches(env):
    r, registry, tok = env
    live_worker(registry)
    JobStore(r, KEYS).create("j", model="tiny")
    messages = [{"role": "user", "content": "hi"}]
    tagged = {"prompt_token_ids": [5, 6, 7], "max_tokens": 2, "custom_id": "c", "metadata": {"k": "v"}}
    submit(r, "j", [{"prompt": "hello", "max_tokens": 5}, {"messages": messages, "max_tokens": 3}, tagged])
    run_until_idle(make_scheduler(r))
    got = {q.idx: q for b in batches(r) for q in b}
    assert got[0].prompt_token_ids == tok.encode("hello")
    assert got[1].prompt_token_ids == tok.apply_chat_template(messages, tokenize=True)
    assert got[2].prompt_token_ids == [5, 6, 7] and got[2].custom_id == "c" and got[2].metadata == {"k": "v"}
    assert got[0].request_id == "j:0" and got[0].line == 1
    # the speculative-decoding fields at their defaults are left out (older workers read the line)
    assert got[0].sampling_params == {k: v for k, v in SamplingParams(max_tokens=5).to_dict().items()
                                      if k not in ("speculative", "prediction")}
    assert got[2].to_dict() == BatchRequest.from_dict(got[2].to_dict()).to_dict()
    assert r.xlen(KEYS.requests) == 0  # acked and deleted: nothing left behind in intake
    assert r.xpending(KEYS.requests, SCHEDULER_GROUP)["pending"] == 0


def test_bad_entries_become_error_rows_with_line_numbers(env):
    r, registry, _ = env
    live_worker(registry)
    JobStore(r, KEYS).create("j", model="tiny")
    submit(r, "j", ['{"prompt": "ok", "max_tokens": 2}', "{not json", {"prompt": "x", "bogus": 1},
                    {"prompt": "a" * 200, "max_tokens": 10}, {"prompt_token_ids": [1, 999999]},
                    {"prompt": "x", "max_tokens": 128, "model": "tiny"}])
    r.xadd(KEYS.requests, {"v": "9", "body": "{}", "job": "j", "idx": "6", "line": "7"})
    r.xadd(KEYS.requests, {"hello": "world"})  # a foreign entry: no job, so a direct error row
    run_until_idle(make_scheduler(r))
    got = rows(r, "j")
    assert {i: (row.error_code, row.line) for i, row in got.items()} == {
        1: ("invalid_json", 2), 2: ("invalid_request", 3), 3: ("prompt_too_long", 4),
        4: ("invalid_request", 5), 5: ("prompt_too_long", 6), 6: ("protocol_error", 7)}
    assert "bogus" in got[2].error_message and "999999" in got[4].error_message
    assert "128" in got[3].error_message  # names the context length
    (_, direct), = r.xrange(KEYS.results("direct"))
    assert ResultRow.from_json(direct[b"row"]).error_code == "protocol_error"
    assert [q.idx for b in batches(r) for q in b] == [0]  # the good line still goes on
    assert JobStore(r, KEYS).get("j").failed == 6


def test_unknown_model_is_held_then_served_or_rejected(env):
    r, registry, _ = env
    wall = FakeClock.from_now()
    sched = make_scheduler(r, hold=0.3, wall=wall)
    r.xadd(KEYS.requests, IntakeEntry(body=json.dumps({"prompt": "hi", "model": "later"})).to_fields())
    r.xadd(KEYS.requests, IntakeEntry(body=json.dumps({"prompt": "hi", "model": "never"}),
                                      reply_to="{t}:reply:x").to_fields())
    sched.run_once()
    assert r.xlen(held_key(KEYS)) == 2 and r.xlen(KEYS.results("direct")) == 0
    registry.register_model("later", registry.get_model("tiny").files, CAP)
    registry.heartbeat_worker("w2", {"model": "later", "capacity": CAP}, ttl=60)
    sched.admission.models.refresh = 0
    assert sched.intake.sweep_held() == 1  # "later" is served now; "never" is within its hold
    sched.dispatcher.step()
    assert len(batches(r, "later")) == 1
    assert r.xlen(held_key(KEYS)) == 1 and not r.exists("{t}:reply:x")
    wall.advance(0.35)  # past the 0.3 s hold
    assert sched.intake.sweep_held() == 1
    assert r.xlen(held_key(KEYS)) == 0
    (_, reply), = r.xrange("{t}:reply:x")
    assert ResultRow.from_json(reply[b"row"]).error_code == "unknown_model"


def test_a_held_backlog_drains_without_waiting_for_the_sweep_timer(env):
    # Requests that arrive before their model's worker registers are held; once it is served they
    # must all move on at once, not 500 per 2-second sweep (a 1M-request job would trickle an hour).
    r, registry, _ = env
    clock = FakeClock()  # stands still but when advanced: the sweep timer fires only when the test says
    sched = make_scheduler(r, clock=clock)
    body = json.dumps({"prompt": "hi", "model": "later", "max_tokens": 2})
    pipe = r.pipeline()
    for _ in range(1600):
        pipe.xadd(KEYS.requests, IntakeEntry(body=body).to_fields())
    pipe.execute()
    run_until_idle(sched, passes=50)
    assert r.xlen(held_key(KEYS)) == 1600
    registry.register_model("later", registry.get_model("tiny").files, CAP)
    registry.heartbeat_worker("w2", {"model": "later", "capacity": CAP}, ttl=60)
    sched.admission.models.refresh = 0
    clock.advance(2.0)  # one sweep period: the timer fires once, and not again in these passes (the
    for _ in range(8):  # clock stands still), so the re-sweeps alone drain 1600 > one sweep's 500
        sched.run_once()
    assert r.xlen(held_key(KEYS)) == 0


def test_lease_expiry_redispatches_unpublished_and_dead_letters(env):
    r, registry, _ = env
    live_worker(registry)
    JobStore(r, KEYS).create("j", model="tiny")
    submit(r, "j", [{"prompt": "a", "max_tokens": 2}, {"prompt": "b", "max_tokens": 2}])
    sched = make_scheduler(r, lease_seconds=LEASE_S, max_attempts=2)
    sched.run_once()
    publisher = Publisher(r, KEYS)
    for attempt in (1, 2):
        ((stream, [(entry_id, fields)]),) = r.xreadgroup(WORKERS_GROUP, "w1", {KEYS.batches("tiny"): ">"})
        requests = [BatchRequest.from_dict(q) for q in json.loads(fields[b"requests"])]
        if attempt == 1:  # the worker publishes idx 0, then dies with idx 1 in flight
            assert [q.idx for q in requests] == [0, 1]
            publisher.publish(ResultRow(job_id="j", idx=0, request_id="j:0", status="completed"))
            assert b"solo" not in fields
        else:
            assert [(q.idx, q.attempts) for q in requests] == [(1, 1)]  # published idx 0 was dropped
            assert fields[b"solo"] == b"1"  # its last attempt: it runs alone
        assert wait_until(sched.leases.step, what="the lease to expire") == 1
        assert not r.xrange(KEYS.batches("tiny"), min=entry_id, max=entry_id)  # old entry acked + deleted
    assert r.xlen(KEYS.batches("tiny")) == 0  # 2 failures = max_attempts: no third batch
    (_, letter), = r.xrange(KEYS.deadletter)
    assert json.loads(letter[b"request"])["idx"] == 1
    got = rows(r, "j")
    assert got[1].error_code == "dead_lettered" and got[0].status == "completed"
    assert r.hget(KEYS.attempts("j"), "1") == b"2"


def test_an_unreadable_batch_is_dead_lettered_whole_when_its_lease_expires(env):
    r, registry, _ = env
    live_worker(registry)
    stream = KEYS.batches("tiny")
    ensure_group(r, stream, WORKERS_GROUP)
    entry_id = r.xadd(stream, {"requests": "not json", "model": "tiny"})
    r.xreadgroup(WORKERS_GROUP, "w1", {stream: ">"})  # a worker took it, then died
    leases = make_scheduler(r, lease_seconds=LEASE_S).leases
    assert wait_until(leases.step, what="the lease to expire") == 1
    (_, letter), = r.xrange(KEYS.deadletter)
    assert letter[b"requests"] == b"not json" and letter[b"model"] == b"tiny"  # the entry as it was
    assert letter[b"batch"] == entry_id and letter[b"error"].startswith(b"unreadable batch entry: ")
    assert r.xlen(stream) == 0


def test_restart_rereads_own_pending_entries(env):
    r, registry, _ = env
    live_worker(registry)
    JobStore(r, KEYS).create("j", model="tiny")
    make_scheduler(r).intake.ensure_group()
    submit(r, "j", [{"prompt": "a"}, {"prompt": "b"}, {"prompt": "c"}, {"prompt": "d"}])
    # a scheduler read these and crashed before settling them: they sit in its pending list
    ((_, read),) = r.xreadgroup(SCHEDULER_GROUP, "scheduler", {KEYS.requests: ">"}, count=3)
    r.xdel(KEYS.requests, read[2][0])  # and a producer deleted one meanwhile
    run_until_idle(make_scheduler(r))
    assert sorted(q.idx for b in batches(r) for q in b) == [0, 1, 3]
    assert r.xlen(KEYS.results("j")) == 0
    assert r.xpending(KEYS.requests, SCHEDULER_GROUP)["pending"] == 0


def test_cancelled_job_gets_cancelled_rows_from_intake_and_staging(env):
    r, registry, _ = env
    store = JobStore(r, KEYS)
    store.create("j", model="tiny")
    sched = make_scheduler(r)
    submit(r, "j", [{"prompt": "a"}, {"prompt": "b"}])  # no live worker: they wait in staging
    sched.run_once()
    assert batches(r) == [] and rows(r, "j") == {}
    store.cancel("j")
    submit(r, "j", [{"prompt": "c"}], start=2)  # arrives after the cancel
    run_until_idle(sched)
    assert {i: row.status for i, row in rows(r, "j").items()} == dict.fromkeys([0, 1, 2], "cancelled")
    assert batches(r) == []


def test_backpressure_keeps_two_batches_per_live_worker(env):
    r, registry, _ = env
    live_worker(registry)
    JobStore(r, KEYS).create("j", model="tiny")
    submit(r, "j", [{"prompt": f"p{i}", "max_tokens": 4} for i in range(40)])
    sched = make_scheduler(r)
    run_until_idle(sched)
    assert r.xlen(KEYS.batches("tiny")) == 2  # 4 requests each; 32 stay staged in Redis
    r.xreadgroup(WORKERS_GROUP, "w1", {KEYS.batches("tiny"): ">"}, count=1)  # a worker takes one
    run_until_idle(sched)
    assert r.xlen(KEYS.batches("tiny")) == 3  # two undelivered again, plus the delivered one
    live_worker(registry, "w2")
    run_until_idle(sched)
    assert r.xlen(KEYS.batches("tiny")) == 5  # two workers: four undelivered
    assert sum(len(b) for b in batches(r)) == 20


def test_fair_share_small_job_is_not_starved(env):
    r, registry, _ = env
    live_worker(registry)
    store = JobStore(r, KEYS)
    store.create("big", model="tiny")
    store.create("small", model="tiny")
    submit(r, "big", [{"prompt": "b", "max_tokens": 4}] * 60)
    submit(r, "small", [{"prompt": "s", "max_tokens": 4}] * 2)  # arrives behind all of big
    sched = make_scheduler(r)
    run_until_idle(sched)
    # Slow start: the first read took FIRST_CHUNK (32) of big's entries only, and their batches
    # went out at once (the worker was idle); small's entries were read in the next pass.
    assert [{q.job_id for q in b} for b in batches(r)] == [{"big"}, {"big"}]
    r.xreadgroup(WORKERS_GROUP, "w1", {KEYS.batches("tiny"): ">"}, count=2)  # the worker takes both
    run_until_idle(sched)
    next_two = batches(r)[2:]
    assert {q.job_id for b in next_two for q in b} == {"big", "small"}  # not behind big's other 50
    assert sum(q.job_id == "small" for b in next_two for q in b) == 2


def test_duplicate_client_request_id_is_dropped(env):
    r, registry, _ = env
    live_worker(registry)
    sched = make_scheduler(r)
    for _ in range(2):
        r.xadd(KEYS.requests, IntakeEntry(body=json.dumps({"prompt": "a", "model": "tiny"}),
                                          client_request_id="abc").to_fields())
    run_until_idle(sched)
    assert sum(len(b) for b in batches(r)) == 1
    assert sched.admission.duplicates == 1


def test_accounting_expires_jobs_and_requeues_lost_exports(env):
    r, registry, _ = env
    store = JobStore(r, KEYS)
    store.create("old", model="tiny")
    r.hset(KEYS.job("old"), mapping={"expires_at": 1, "submitted": 2})
    store.create("done", model="tiny")
    r.hset(KEYS.job("done"), mapping={"status": "finalizing", "export_requested_at": 1, "total": 0})
    store.create("gone", model="tiny")  # its submitter was interrupted, and cancelled it
    store.cancel("gone")
    r.hset(KEYS.job("gone"), mapping={"cancelling_at": 1, "submitted": 0})
    sched = make_scheduler(r)
    assert sched.accounting.step() == 3
    assert store.get("gone").total == 0 and r.hexists(KEYS.job("gone"), "export_requested_at")
    old = store.get("old")
    assert old.status == "expired" and old.total == 2 and r.sismember(KEYS.cancelled, "old")
    from rq.job import Job

    from batchinfer.jobs.export import rq_job_id

    assert Job.exists(rq_job_id("export", "{t}", "done"), connection=r)
    assert sched.accounting.step() == 0  # nothing more to do: the export is queued now


def test_run_survives_redis_restart(env, redis_server):
    from batchinfer.redis_conn import connect

    r = connect(redis_server.url)
    registry = Registry(r, KEYS)
    files = registry.get_model("tiny").files
    sched = make_scheduler(r)
    sched.block_ms = 50
    stop = threading.Event()
    thread = threading.Thread(target=sched.run, args=(stop,), daemon=True)
    thread.start()
    try:
        redis_server.stop()
        time.sleep(0.3)
        redis_server.start()  # a fresh, empty Redis: groups must be re-created
        registry.register_model("tiny", files, CAP)
        live_worker(registry)
        r.xadd(KEYS.requests, IntakeEntry(body=json.dumps({"prompt": "a", "model": "tiny"})).to_fields())
        deadline = time.monotonic() + 20
        while not r.xlen(KEYS.batches("tiny")) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(batches(r)) == 1
    finally:
        stop.set()
        thread.join(timeout=10)
    assert not thread.is_alive()



def test_daemons_enqueue_exports_without_loading_pyarrow(redis_server):
    """The scheduler and the workers enqueue exports (and check for them) without importing the
    exporter's pyarrow: ~40 MB of resident memory per daemon, which the soak saw as the
    scheduler's peak RSS jumping from 58 to 97 MB once a job's export was overdue."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from batchinfer.config import Settings\n"
        "from batchinfer.keys import Keys\n"
        "from batchinfer.scheduler.lookups import JobCache, RowSink\n"
        "from batchinfer.scheduler.accounting import Accounting\n"
        "from batchinfer.redis_conn import connect\n"
        "import batchinfer.scheduler.daemon, batchinfer.workers.service.daemon\n"
        f"s = Settings(redis_url={redis_server.url!r}, prefix='{{t}}')\n"
        "r, keys = connect(s.redis_url), Keys(s.prefix)\n"
        "sink = RowSink(r, s, keys)\n"
        "sink.enqueue_export('j1')\n"
        "assert Accounting(r, keys, s, JobCache(r, keys), sink)._export_queued('j1')\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('pyarrow', 'pandas')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_retry_batches_send_last_attempts_alone():
    def req(idx: int, attempts: int) -> BatchRequest:
        return BatchRequest(request_id=f"j:{idx}", job_id="j", idx=idx, prompt_token_ids=[1],
                            sampling_params={}, model="tiny", attempts=attempts)

    entries = retry_batches([req(0, 1), req(1, 2), req(2, 0), req(3, 2)], max_attempts=3)
    got = [([q["idx"] for q in json.loads(e["requests"])], e.get("solo")) for e in entries]
    assert got == [([0, 2], None), ([1], "1"), ([3], "1")]
    assert all(e["v"] == "1" for e in entries)
    assert retry_batches([req(0, 0)], max_attempts=1) == [encode([req(0, 0)], solo=True)]
    assert retry_batches([], max_attempts=3) == []


def test_intake_reads_small_after_idle_then_doubles_to_its_chunk(env):
    """Slow start: after an idle read the intake takes FIRST_CHUNK new entries, then twice as many
    each pass up to its chunk; an empty read starts it small again."""
    r, registry, _ = env
    live_worker(registry)
    JobStore(r, KEYS).create("j", model="tiny")
    submit(r, "j", [{"prompt": "p", "max_tokens": 4}] * 600)
    sched = make_scheduler(r)
    sched.run_once()  # takes the partition, reads the first chunk
    assert r.xlen(KEYS.requests) == 600 - 32  # taken in entries are acked and deleted
    intake = sched.intake
    assert [intake.step(None) for _ in range(5)] == [64, 128, 256, 120, 0]
    assert intake.next_chunk == 32
    submit(r, "j", [{"prompt": "p", "max_tokens": 4}] * 40, start=600)
    assert [intake.step(None), intake.step(None), intake.step(None)] == [32, 8, 0]
    assert r.xlen(KEYS.requests) == 0
