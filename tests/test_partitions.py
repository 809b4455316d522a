"""Partitions of the queue (issue 32, part 1): the key names, the routing rules producers follow, the
spread of partitions over schedulers, and jobs and direct requests through two schedulers and one
worker on a real redis-server with ``BATCHINFER_PARTITIONS=2``."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import threading
import time
from collections import Counter

import pytest
import redis
from daemons import Schedulers, ThreadedWorker, dispatched, interleave, job_in, wait_until, worker_daemon
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from redis.crc import key_slot

from batchinfer.client.client import Client
from batchinfer.config import Settings
from batchinfer.keys import Keys, direct_request_id, partition_of
from batchinfer.protocol import batches
from batchinfer.protocol.entries import IntakeEntry, JobOp
from batchinfer.protocol.rows import BatchRequest, ResultRow
from batchinfer.scheduler.daemon import SchedulerDaemon
from batchinfer.store.jobstore import JobStore
from batchinfer.store.ownership import live_schedulers, share_of, to_release
from batchinfer.store.publish import Publisher
from batchinfer.store.queue_state import queue_state
from batchinfer.store.registry import PartitionsMismatch
from batchinfer.workers.service.echo_engine import EchoEngine
from batchinfer.workers.service.streams import BatchStreams, entry_key, split_key

TAKEOVER_S = 0.9


# -- names ----------------------------------------------------------------------------------------


def test_one_partition_names_every_key_as_before():
    keys = Keys("{bi}")
    assert (keys.requests, keys.batches("m"), keys.job("j"), keys.results("j"), keys.published("j"),
            keys.held, keys.scheduler_owner, keys.queue("m", "0:j"), keys.jobs, keys.results("direct")) == (
        "{bi}:requests", "{bi}:batches:m", "{bi}:job:j", "{bi}:results:j", "{bi}:published:j",
        "{bi}:held", "{bi}:scheduler:owner", "{bi}:queue:m:0:j", "{bi}:jobs", "{bi}:results:direct")
    assert keys.parts() == [keys] and keys.for_job("j") is keys and keys.for_direct("c") is keys
    assert Keys("{bi}", 4).part(0).requests == "{bi}:requests"  # partition 0 keeps the old names


def test_a_partition_moves_the_hash_tag():
    assert Keys("{bi}", 4).partition_prefix(3) == "{bi.3}"
    assert Keys("app{t}x", 2).partition_prefix(1) == "app{t.1}x"  # only the tag changes
    assert Keys("bi", 2).partition_prefix(1) == "bi.1"  # no tag: the name changes
    assert Keys("{}x", 2).partition_prefix(1) == "{}x.1"  # an empty tag is no tag to Redis Cluster
    assert Keys("{bi}", 3).part(2).requests == "{bi.2}:requests"


def test_partition_of_is_crc32_of_the_id():
    # 0xCBF43926 is CRC-32's published check value for "123456789": any language's zlib/IEEE CRC-32
    assert partition_of("123456789", 1000) == 0xCBF43926 % 1000 == 262
    assert partition_of("anything", 1) == 0
    keys = Keys("{bi}", 8)
    spread = Counter(keys.job_partition(f"job-{i}") for i in range(800))
    assert set(spread) == set(range(8)) and min(spread.values()) > 60  # every partition gets jobs


def test_everything_of_a_job_shares_one_slot_and_partitions_get_different_slots():
    keys = Keys("{bi}", 4)
    for job in ("a", "job-1", "ü-9"):
        home = keys.for_job(job)
        assert home.partition == partition_of(job, 4)
        names = [keys.job(job), keys.results(job), keys.published(job), keys.attempts(job),
                 keys.admitted(job), home.requests, home.batches("m"), home.queue("m", f"0:{job}"),
                 home.queues("m"), home.held, home.held_models, home.scheduler_owner, home.scheduler_epoch,
                 home.jobs, home.cancelled, home.deadletter, home.reply("t"),
                 keys.idempotency("c", job), keys.redelivery("r", job)]  # one publication's keys too
        assert len({key_slot(n.encode()) for n in names}) == 1, names
        assert {k.job(job) for k in keys.parts()} == {keys.job(job)}  # the same name from every view
    assert len({key_slot(k.requests.encode()) for k in keys.parts()}) == 4
    direct = [keys.results("direct"), keys.published_direct("1-0"), keys.redelivery("1-0"), keys.jobs,
              keys.idempotency("c"), keys.reply("t"), keys.deadletter, keys.attempts("direct"),
              keys.workers, keys.schedulers, keys.cancelled_requests, keys.partitions_count]
    assert {key_slot(n.encode()) for n in direct} == {key_slot(b"{bi}")}  # registries: partition 0's slot
    assert keys.reply_partition("{bi.2}:reply:t") == 2 and keys.reply_partition("{bi}:reply:t") == 0
    outside = ("{bi}:reply:", "{bi.9}:reply:t", "{bx}:reply:t", "t")  # no token, no such partition...
    assert [keys.reply_partition(n) for n in outside] == [None] * 4


def test_bad_partition_settings_are_refused_with_their_name():
    with pytest.raises(ValueError, match="BATCHINFER_PARTITIONS.*got 0"):
        Keys("{bi}", 0)
    with pytest.raises(ValueError, match="BATCHINFER_PARTITIONS"):
        Settings(partitions=5000).keys()
    with pytest.raises(ValueError, match=r"partition must be in 0\.\.1"):
        Keys("{bi}", 2, partition=2)
    assert Settings.from_env({"BATCHINFER_PARTITIONS": "4"}).keys().partitions == 4


def test_direct_ids_and_worker_entry_keys_carry_the_partition():
    assert direct_request_id("17-0", 0) == "17-0" and direct_request_id("17-0", 3) == "17-0@3"
    assert Keys("{bi}", 4).part(3).direct_id("17-0") == "17-0@3"
    for adapter in (None, "sql"):
        for partition in (0, 1, 5):
            key = entry_key(adapter, "17-4", partition)
            assert split_key(key) == (adapter, "17-4", partition)
    assert entry_key(None, "17-4") == "17-4" and entry_key("sql", "17-4") == "sql/17-4"  # as before
    streams = BatchStreams(Keys("{bi}", 2), "m", ["sql"])
    assert streams.all() == ["{bi}:batches:m", "{bi.1}:batches:m",
                             "{bi}:batches:m:sql", "{bi.1}:batches:m:sql"]
    for stream in streams.all():
        assert streams.stream_of(streams.key(stream, "5-0")) == stream
    assert streams.by_stream(["1-0", "2-0@1", "sql/3-0@1"]) == {
        "{bi}:batches:m": ["1-0"], "{bi.1}:batches:m": ["2-0"], "{bi.1}:batches:m:sql": ["3-0"]}
    with pytest.raises(ValueError, match="'@'"):
        BatchStreams(Keys("{bi}", 2), "m", ["a@b"])


# -- the spread (pure) ----------------------------------------------------------------------------


def test_the_share_spreads_partitions_evenly():
    assert [share_of(4, n) for n in (0, 1, 2, 3, 4, 5)] == [4, 4, 2, 2, 1, 1]
    assert share_of(1, 3) == 1  # one partition: one owner, the others stand by
    assert to_release([0, 1, 2, 3], 2) == [2, 3] and to_release([1], 1) == [] and to_release([], 2) == []


@given(partitions=st.integers(1, 64), schedulers=st.integers(1, 64))
def test_the_shares_of_live_schedulers_cover_every_partition_and_no_more_than_needed(partitions, schedulers):
    share = share_of(partitions, schedulers)
    assert share * schedulers >= partitions  # nobody's partition is left without an owner
    assert (share - 1) * schedulers < partitions  # and no scheduler takes one more than needed


# -- on a real Redis ------------------------------------------------------------------------------


def _settings(server, prefix: str) -> Settings:
    return Settings(redis_url=server.url, prefix=prefix, partitions=2, scheduler_takeover_seconds=TAKEOVER_S,
                    heartbeat_seconds=0.3)


def _rows(r, keys: Keys, job: str) -> list[ResultRow]:
    return [ResultRow.from_json(f[b"row"]) for _, f in r.xrange(keys.results(job))]


def _owned(r, keys: Keys) -> dict[str, tuple[int, ...]]:
    return {v.token.split(":", 1)[0]: v.partitions for v in live_schedulers(r, keys.schedulers)}


@contextlib.contextmanager
def _partitioned(redis_server, prefix: str):
    """``(redis, settings, keys, schedulers)`` of a two-partition queue served by one echo worker in a
    thread; the schedulers the test starts are stopped, and the worker drained, at the end."""
    r = redis_server.client()
    settings = _settings(redis_server, prefix)
    worker = ThreadedWorker(worker_daemon(r, settings, EchoEngine(max_num_seqs=8), name="w1", block_ms=50))
    scheds = Schedulers(r, settings)
    try:
        yield r, settings, settings.keys(), scheds
    finally:
        scheds.close()
        assert worker.stop() == 0


def test_two_schedulers_share_two_partitions_and_every_request_gets_one_row(redis_server):
    with _partitioned(redis_server, "{pt}") as (r, settings, keys, scheds):
        scheds.start("a")
        wait_until(lambda: _owned(r, keys).get("a") == (0, 1), timeout=10, what="a alone owns both")
        scheds.start("b")
        # b joins: a gives its share's excess up and b takes it, within a rebalance or two
        wait_until(lambda: sorted(_owned(r, keys).values()) == [(0,), (1,)], timeout=10,
                   what="one partition each")
        client = Client(settings=settings)
        jobs = [job_in(keys, p, "job-") for p in (0, 1)]
        for job in jobs:
            client.submit([{"prompt": f"{job} line {i}", "max_tokens": 3} for i in range(40)], model="echo",
                          job_id=job)
        # direct requests go to their client_request_id's partition
        ids = [f"c{i}" for i in range(12)]
        direct = list(client.requests([{"prompt": f"direct {i}", "max_tokens": 2} for i in range(12)],
                                      model="echo", client_request_ids=ids, timeout=30))
        for job in jobs:
            wait_until(lambda job=job: len(_rows(r, keys, job)) == 40, timeout=30, what=f"{job}'s rows")
        client.close()
    for job in jobs:
        rows = _rows(r, keys, job)
        assert sorted(row.idx for row in rows) == list(range(40))  # every idx once
        assert all(row.status == "completed" for row in rows)
        assert JobStore(r, keys).get(job).status.value in ("finalizing", "completed")
    assert len(direct) == 12 and len({row.request_id for row in direct}) == 12
    home = {f"c{i}": partition_of(f"c{i}", 2) for i in range(12)}
    assert set(home.values()) == {0, 1}  # the ids chosen land in both partitions
    by_partition = Counter(int(row.request_id.partition("@")[2] or 0) for row in direct)
    assert by_partition == Counter(home.values())
    for view in keys.parts():  # both partitions' streams carried work, and none is left behind
        assert r.xinfo_stream(view.requests)["entries-added"] > 0
        assert r.xinfo_stream(view.batches("echo"))["entries-added"] > 0
    state = queue_state(r, keys)
    assert state.intake.undelivered == 0 and state.batches["echo"].undelivered == 0
    assert live_schedulers(r, keys.schedulers) == []  # clean stops withdraw and release
    assert [r.get(k.scheduler_owner) for k in keys.parts()] == [None, None]


def test_a_scheduler_that_stops_hands_its_partition_over(redis_server):
    with _partitioned(redis_server, "{pu}") as (r, settings, keys, scheds):
        scheds.start("a")
        scheds.start("b")
        wait_until(lambda: sorted(_owned(r, keys).values()) == [(0,), (1,)], timeout=10, what="one each")
        scheds.stop("a")
        wait_until(lambda: _owned(r, keys).get("b") == (0, 1), timeout=10, what="b to take both")
        client = Client(settings=settings)
        jobs = [job_in(keys, p, "late-") for p in (0, 1)]
        for job in jobs:
            client.submit([{"prompt": f"{i}", "max_tokens": 2} for i in range(10)], model="echo", job_id=job)
        for job in jobs:
            wait_until(lambda job=job: len(_rows(r, keys, job)) == 10, timeout=30, what=f"{job}'s rows")
        client.close()


def _a_job_in_partition_1(redis_server, prefix: str) -> tuple[redis.Redis, Settings, Keys, str]:
    """``(redis, settings, keys, job)``: a two-partition queue and an open job of partition 1."""
    r = redis_server.client()
    settings = _settings(redis_server, prefix)
    keys = settings.keys()
    job = job_in(keys, 1, "w-")
    JobStore(r, keys).create(job, model="echo")
    return r, settings, keys, job


def test_an_entry_in_the_wrong_partition_is_refused_with_where_it_belongs(redis_server):
    r, settings, keys, job = _a_job_in_partition_1(redis_server, "{pw}")
    wrong = keys.part(0)
    entry = IntakeEntry(body=json.dumps({"prompt": "x"}), job_id=job, idx=0, line=1)
    r.xadd(wrong.requests, entry.to_fields())
    reply = keys.reply("op")
    r.xadd(wrong.requests, dataclasses.replace(JobOp.close(job, 1), reply_to=reply).to_fields())
    sched = SchedulerDaemon(r, settings, instance="a")
    for _ in range(3):
        sched.run_once()
    (row,) = _rows(r, keys, job)
    assert row.status == "failed" and row.error_code == "protocol_error" and row.idx == 0
    assert "partition 1 of 2" in row.error_message and keys.part(1).requests in row.error_message
    (_, answer), = r.xrange(reply)
    op_row = json.loads(answer[b"row"])
    assert op_row["error_code"] == "protocol_error" and "op close was not applied" in op_row["error_message"]
    assert JobStore(r, keys).get(job).total is None  # the close was not applied


def test_a_reply_to_outside_its_rows_partition_is_refused_naming_the_right_namespace(redis_server):
    """A row's publication touches one slot: a job's entry may name a reply stream of its job's
    partition only (a direct request's: partition 0's); an op's answer, written alone, any."""
    r, settings, keys, job = _a_job_in_partition_1(redis_server, "{pr}")
    home = keys.part(1)
    for idx, reply in enumerate([keys.reply("elsewhere"), home.reply("mine")]):
        entry = IntakeEntry(body=json.dumps({"prompt": "x"}), job_id=job, idx=idx, line=idx + 1,
                            reply_to=reply)
        r.xadd(home.requests, entry.to_fields())
    direct = IntakeEntry(body=json.dumps({"prompt": "y"}), reply_to=home.reply("direct"))
    r.xadd(home.requests, direct.to_fields())
    sched = SchedulerDaemon(r, settings, instance="a")
    for _ in range(3):
        sched.run_once()
    refused = {row.idx: row for row in _rows(r, keys, job) if row.error_code == "protocol_error"}
    assert list(refused) == [0]
    assert "is in partition 0" in refused[0].error_message and home.reply("") in refused[0].error_message
    assert r.xlen(keys.reply("elsewhere")) == 0  # nothing written to the other partition's stream
    (row,) = [ResultRow.from_json(f[b"row"]) for _, f in r.xrange(keys.results("direct"))]
    assert row.error_code == "protocol_error" and "a direct request" in row.error_message
    assert keys.reply("") in row.error_message and r.xlen(home.reply("direct")) == 0


def test_a_worker_reads_every_partition_fairly(redis_server):
    """A worker with batches waiting in both partitions takes from both in turn: one partition's
    backlog does not starve the other's."""
    r = redis_server.client()
    settings = _settings(redis_server, "{pf}")
    keys = settings.keys()
    worker = worker_daemon(r, settings, EchoEngine(max_num_seqs=64), name="w1", block_ms=50)
    worker.reader.ensure_groups()
    with pytest.raises(redis.ResponseError, match="BUSYGROUP"):
        r.xgroup_create(keys.part(1).batches("echo"), "workers", id="0")  # made in every partition
    for view in keys.parts():
        for i in range(3):
            job = job_in(keys, view.partition, f"f{i}-")
            request = BatchRequest(request_id=f"{job}:0", job_id=job, idx=0, prompt_token_ids=[1, 2],
                                   sampling_params={"max_tokens": 1}, model="echo")
            r.xadd(view.batches("echo"), batches.encode([request]))
    read = worker.reader.read(idle=True, block_ms=None)
    assert sorted(split_key(key)[2] for key, _ in read) == [0, 1]  # idle: one of each, not two of one
    # busy (it holds work): one batch a read, the partitions in turn
    turns = [[split_key(key)[2] for key, _ in worker.reader.read(idle=False, block_ms=None)]
             for _ in range(5)]
    assert turns == [[0], [1], [0], [1], []]  # two left in each, then nothing: no partition waited


def test_a_process_with_another_partition_count_is_refused(redis_server):
    r = redis_server.client()
    settings = _settings(redis_server, "{pm}")
    keys = settings.keys()
    Client(settings=settings).check_partitions()  # the first process records the deployment's count
    assert r.get(keys.partitions_count) == b"2"
    other = Settings(redis_url=redis_server.url, prefix="{pm}", partitions=3)
    with pytest.raises(PartitionsMismatch, match=r"BATCHINFER_PARTITIONS is 3 here, but this deployment "
                                                 r"\(\{pm\}\) runs with 2"):
        SchedulerDaemon(r, other).run(threading.Event())
    client = Client(settings=other)
    with pytest.raises(ValueError, match="BATCHINFER_PARTITIONS is 3"):
        client.submit([{"prompt": "x"}], model="echo")
    assert r.xlen(Keys("{pm}", 3).requests) == 0 and r.zcard(keys.jobs) == 0  # nothing was sent
    worker = ThreadedWorker(worker_daemon(r, other, EchoEngine(), name="w9", block_ms=50))
    worker.thread.join(timeout=30)
    assert isinstance(worker.error, PartitionsMismatch) and r.exists(keys.worker("w9")) == 0


def test_doctor_names_a_partition_count_that_is_not_the_deployments(redis_server):
    from batchinfer.cli.doctor import check_partitions_setting
    from batchinfer.store.registry import check_partitions

    r = redis_server.client()
    first = check_partitions_setting(r, Keys("{pd}", 2))
    assert first.ok and "no scheduler or worker has run under {pd}" in first.detail
    check_partitions(r, Keys("{pd}", 2))
    assert check_partitions_setting(r, Keys("{pd}", 2)).ok
    wrong = check_partitions_setting(r, Keys("{pd}", 4))
    assert not wrong.ok and wrong.detail == "BATCHINFER_PARTITIONS=4; the deployment's: 2"
    assert wrong.fix.startswith("set BATCHINFER_PARTITIONS=2")


# -- two schedulers over two partitions, passes interleaved step by step ---------------------------

LAPSE_S = 0.1
CAP = {"max_model_len": 128, "max_num_seqs": 4, "max_num_batched_tokens": 256, "kv_tokens": 4096}


@pytest.fixture(scope="module")
def tiny_files(tiny_llama):
    from batchinfer.workers.text.tokenizer_files import read_tokenizer_files

    return read_tokenizer_files(tiny_llama)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(steps=st.lists(st.sampled_from(["a", "b", "lapse", "submit"]), min_size=4, max_size=16))
def test_interleaved_passes_over_two_partitions_dispatch_every_request_once(redis_server, tiny_files, steps):
    """Two schedulers' passes in any order over two partitions (taking, spreading and giving up
    partitions as they go, leases lapsing at any point, jobs arriving in either partition): every
    request ends up in exactly one batch or staging entry, and each partition has one holder at most."""
    from batchinfer.store.registry import Registry

    r = redis_server.client()
    r.flushdb()
    keys = Keys("{pi}", 2)
    Registry(r, keys).register_model("tiny", tiny_files, CAP)
    Registry(r, keys).heartbeat_worker("w1", {"model": "tiny", "capacity": CAP}, ttl=600)
    config = Settings(prefix=keys.prefix, partitions=2, scheduler_takeover_seconds=LAPSE_S)
    scheds = {name: SchedulerDaemon(r, config, instance=name) for name in ("a", "b")}
    for sched in scheds.values():
        for part in sched.parts:
            part.dispatcher.jobs.ttl = part.admission.jobs.ttl = 0
    jobs: list[str] = []

    def submit() -> None:  # a job of three requests, in whichever partition its id picks
        job = f"j{len(jobs)}"
        jobs.append(job)
        JobStore(r, keys).create(job, model="tiny")
        for i in range(3):
            entry = IntakeEntry(body=json.dumps({"prompt": f"p{i}", "max_tokens": 2}), job_id=job, idx=i,
                                line=i + 1)
            r.xadd(keys.for_job(job).requests, entry.to_fields())

    interleave(steps, scheds, submit, LAPSE_S)
    tokens = {s.token for s in scheds.values()}
    for view in keys.parts():
        holder = r.get(view.scheduler_owner)
        assert holder is None or holder.decode() in tokens
    assert {keys.job_partition(j) for j in jobs} <= {0, 1}
    assert dispatched(r, keys, "tiny") == Counter({(job, i): 1 for job in jobs for i in range(3)})


def test_top_names_each_scheduler_with_its_partitions():
    from batchinfer.cli.top import scheduler_text
    from batchinfer.store.ownership import SchedulerView

    views = [SchedulerView("a:1:x", (0, 2), 0, 2.0), SchedulerView("b:2:y", (1,), 0, 2.0),
             SchedulerView("c:3:z", (), 0, 2.0)]
    text = "schedulers a:1 (partitions 0, 2), b:2 (partition 1) (+1 standing by)"
    assert scheduler_text(views).plain == text
    one = [SchedulerView("a:1:x", (0,), 0, 2.0)]
    assert scheduler_text(one).plain == "scheduler a:1"  # one partition: as before


def test_the_http_api_serves_sync_requests_and_batches_over_two_partitions(redis_server, tiny_llama,
                                                                           tmp_path):
    """The HTTP API's doors route by the partition rules too: synchronous requests (direct, a random
    partition each) and a batch (a job, its id's partition) through the official SDK."""
    from api_stack import ApiStack, serve_sync_and_batch

    stack = ApiStack(redis_server.url, tmp_path / "api", tiny_llama, env={"BATCHINFER_PARTITIONS": "2"})
    try:
        serve_sync_and_batch(stack)
    finally:
        stack.close()


def test_an_api_server_with_another_partition_count_is_not_ready(redis_server):
    from batchinfer.api.app import create_app
    from batchinfer.store.registry import check_partitions

    def readiness(partitions: int) -> tuple[bool, dict]:
        app = create_app(Settings(redis_url=redis_server.url, prefix="{pa}", partitions=partitions))
        return app.state.readiness.check()

    check_partitions(redis_server.client(), Keys("{pa}", 2))
    assert readiness(2) == (True, {"redis": "ok", "partitions": "ok"})
    ready, report = readiness(3)
    assert not ready and report["partitions"].startswith("PartitionsMismatch: BATCHINFER_PARTITIONS is 3")


def test_one_renewal_thread_keeps_every_partition_a_scheduler_owns(redis_server):
    r = redis_server.client()
    config = Settings(redis_url=redis_server.url, prefix="{pr}", partitions=8, scheduler_takeover_seconds=0.6)
    keys = config.keys()
    scheds = Schedulers(r, config)
    try:
        sched = scheds.start("a")
        wait_until(lambda: sched.held() == list(range(8)), timeout=10, what="a to own the 8 partitions")
        renewals = [t for t in threading.enumerate() if t.name == "ownership-renewal"]
        assert len(renewals) == 1  # one thread, not one per partition
        ttls = [r.pttl(k.scheduler_owner) for k in keys.parts()]
        time.sleep(1.5)  # past twice the takeover time: every lease was renewed meanwhile
        assert all(r.get(k.scheduler_owner) == sched.token.encode() for k in keys.parts()), ttls
    finally:
        scheds.close()
    assert [t for t in threading.enumerate() if t.name == "ownership-renewal"] == []


def test_a_worker_s_retries_go_one_multi_per_partition_and_a_failed_one_never_sends_the_others_twice(
        redis_server):
    from batchinfer.workers.service.inflight import Book
    from batchinfer.workers.service.outbox import Outbox

    r = redis_server.client()
    keys = Keys("{po}", 2)
    jobs = [job_in(keys, p, "o-") for p in (0, 1)]
    streams = BatchStreams(keys, "echo")
    outbox = Outbox(r, keys, streams, Publisher(r, keys), enqueue_export=lambda job: None,
                    on_published=lambda rows: None, on_acked=lambda entries: None, max_attempts=3)
    for job in jobs:
        outbox.retry(BatchRequest(request_id=f"{job}:0", job_id=job, idx=0, prompt_token_ids=[65],
                                  sampling_params={"max_tokens": 2}, model="echo", line=1, created_at=1))
    blocked = keys.part(1).batches("echo")
    r.set(blocked, "not a stream")  # partition 1's MULTI fails (WRONGTYPE), partition 0's has run
    with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
        outbox.flush(Book())
    assert [q.job_id for q in outbox.retries] == [jobs[1]]  # only the failed partition's is left
    r.delete(blocked)
    outbox.flush(Book())
    for part, job in zip(keys.parts(), jobs, strict=True):
        (entry,) = r.xrange(part.batches("echo"))  # each request re-dispatched once, in its partition
        assert [q["job_id"] for q in json.loads(entry[1][b"requests"])] == [job]
        assert r.hget(keys.attempts(job), "0") == b"1"
