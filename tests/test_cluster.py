"""Redis Cluster (issue 32, part 3): connecting (``BATCHINFER_REDIS_CLUSTER``, detection), rq on its own
Redis, and the whole path -- jobs, direct requests, retries by ``client_request_id``, cancellation,
held requests, the export -- over three partitions on a real cluster-mode redis-server.

The cluster here is one master owning every slot (:class:`clusters.ClusterSet` with one node): it
answers CROSSSLOT to any script, MULTI or command whose keys span slots, as a cluster of many masters
does, for a two-second start. tests/faults/test_cluster_failover.py runs six processes and kills a
master.
"""

from __future__ import annotations

import contextlib
from collections import Counter

import pyarrow.parquet as pq
import pytest
import redis
from clusters import ClusterSet
from daemons import Schedulers, ThreadedWorker, job_in, wait_until, worker_daemon
from redis.cluster import RedisCluster, key_slot

from batchinfer.client.client import Client
from batchinfer.config import Settings
from batchinfer.keys import DIRECT, Keys
from batchinfer.protocol.rows import ResultRow
from batchinfer.redis_conn import connect, in_cluster, read_groups
from batchinfer.store.jobstore import JobStatus, JobStore
from batchinfer.store.queue_state import held_models, queue_state
from batchinfer.workers.service.echo_engine import EchoEngine

PARTITIONS = 3


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """One cluster-mode redis-server owning all 16384 slots; tests use distinct prefixes."""
    nodes = ClusterSet(tmp_path_factory.mktemp("cluster"), masters=1, replicas=0).start()
    yield nodes
    nodes.stop()


def _settings(cluster: ClusterSet, prefix: str, **kw) -> Settings:
    return Settings(redis_url=cluster.url, redis_cluster="1", prefix=prefix, partitions=PARTITIONS,
                    heartbeat_seconds=0.3, **kw)


def _rows(r, keys: Keys, job: str) -> list[ResultRow]:
    return [ResultRow.from_json(f[b"row"]) for _, f in r.xrange(keys.results(job))]


# -- connecting -------------------------------------------------------------------------------------


def test_a_cluster_is_detected_or_named_and_a_plain_server_is_not_taken_for_one(cluster, redis_server):
    assert in_cluster(connect(cluster.url, cluster=None))  # auto: INFO cluster says so
    assert in_cluster(connect(cluster.url, cluster=True))
    assert not in_cluster(connect(redis_server.url, cluster=None))
    assert not in_cluster(connect("redis://127.0.0.1:1/0", cluster=None))  # nobody there: plain
    assert Settings(redis_cluster="auto").cluster() is None
    assert Settings(redis_cluster="1").cluster() is True and Settings(redis_cluster="no").cluster() is False
    with pytest.raises(ValueError, match="BATCHINFER_REDIS_CLUSTER must be 1, 0 or auto"):
        Settings(redis_cluster="maybe").cluster()
    with pytest.raises(ValueError, match="Sentinel URL names no Cluster"):
        connect("redis+sentinel://127.0.0.1:26379/svc", cluster=True)
    with pytest.raises(ValueError, match="unix socket"):
        connect("unix:///tmp/redis.sock", cluster=True)


def test_rq_needs_a_plain_redis_beside_a_cluster(cluster, redis_server):
    with pytest.raises(ValueError, match="BATCHINFER_RQ_REDIS_URL"):
        _settings(cluster, "{rq}").connect_rq()
    rq = _settings(cluster, "{rq}", rq_redis_url=redis_server.url).connect_rq()
    assert not in_cluster(rq) and rq.ping()
    plain = Settings(redis_url=redis_server.url)
    data = plain.connect()
    assert plain.connect_rq(data) is data  # no rq URL, no cluster: rq shares the data connection


def test_reading_streams_of_several_slots_reads_each_and_blocks_on_one(cluster):
    r = connect(cluster.url, cluster=True)
    keys = Keys("{rd}", partitions=PARTITIONS)
    streams = [k.batches("m") for k in keys.parts()]
    assert len({key_slot(s.encode()) for s in streams}) == PARTITIONS
    with pytest.raises(redis.exceptions.RedisClusterException):  # what one XREADGROUP would do
        r.xreadgroup("g", "c", dict.fromkeys(streams, ">"), count=1)
    starts = dict.fromkeys(streams, ">")
    assert read_groups(r, starts, "g", "c", count=1, block_ms=None) == []  # NOGROUP: groups made
    r.xadd(streams[2], {"n": "2"})
    r.xadd(streams[0], {"n": "0"})
    got = read_groups(r, starts, "g", "c", count=1, block_ms=None)
    assert sorted(name.decode() for name, _ in got) == sorted([streams[0], streams[2]])
    assert read_groups(r, starts, "g", "c", count=1, block_ms=50) == []  # blocks on one slot, briefly


# -- the whole path -----------------------------------------------------------------------------------


@contextlib.contextmanager
def _served(cluster: ClusterSet, redis_server, prefix: str, models: tuple[str, ...] = ("echo",)):
    """``(cluster client, settings)`` with two schedulers and one echo worker per model, in threads."""
    settings = _settings(cluster, prefix, rq_redis_url=redis_server.url)
    r = settings.connect()
    assert isinstance(r, RedisCluster)
    scheds = Schedulers(r, settings)
    workers = [ThreadedWorker(worker_daemon(r, settings, EchoEngine(max_num_seqs=8, model_name=m),
                                            name=f"w-{m}", block_ms=50)) for m in models]
    try:
        scheds.start("a")
        scheds.start("b")
        yield r, settings
    finally:
        scheds.close()
        for worker in workers:
            assert worker.stop() == 0


def test_jobs_direct_requests_retries_and_cancels_over_three_partitions_on_a_cluster(cluster, redis_server,
                                                                                    tmp_path, monkeypatch):
    with _served(cluster, redis_server, "{cl}") as (r, settings):
        keys = settings.keys()
        client = Client(settings=settings)
        jobs = [job_in(keys, p, "job-") for p in range(PARTITIONS)]
        for job in jobs:  # some lines with a client_request_id, one of them sent twice
            lines = [{"prompt": f"{job} line {i}", "max_tokens": 3} for i in range(30)]
            client.submit(lines, model="echo", job_id=job)
        ids = [f"c{i}" for i in range(9)]
        bodies = [{"prompt": f"direct {i}", "max_tokens": 2} for i in range(9)]
        direct = list(client.requests(bodies, model="echo", client_request_ids=ids, timeout=30))
        again = client.request({"prompt": "direct 4", "max_tokens": 2}, model="echo", client_request_id="c4",
                               timeout=30)  # a retry: the first request's row, not a second run
        for job in jobs:
            wait_until(lambda job=job: len(_rows(r, keys, job)) == 30, timeout=60, what=f"{job}'s rows")
        # a job cancelled while its model is not served: held, then answered 'cancelled'
        late = job_in(keys, 2, "late-")
        client.submit([{"prompt": f"late {i}", "max_tokens": 2} for i in range(5)], model="nobody",
                      job_id=late)
        wait_until(lambda: held_models(r, keys).get("nobody") == 5, timeout=30, what="5 held requests")
        assert client.cancel(late) in (JobStatus.CANCELLING, JobStatus.CANCELLED)
        wait_until(lambda: len(_rows(r, keys, late)) == 5, timeout=30, what="the cancelled job's rows")
        state = queue_state(r, keys)
        client.close()
    for job in jobs:
        rows = _rows(r, keys, job)
        assert sorted(row.idx for row in rows) == list(range(30))
        assert {row.status for row in rows} == {"completed"}
    assert {row.status for row in _rows(r, keys, late)} == {"cancelled"}
    assert len({row.request_id for row in direct}) == 9 and {row.status for row in direct} == {"completed"}
    assert again.request_id in {row.request_id for row in direct}  # the first c4's row, sent again
    assert r.xlen(keys.results(DIRECT)) == 9  # and no tenth run
    assert Counter(int(row.request_id.partition("@")[2] or 0) for row in direct).keys() == {0, 1, 2}
    assert state.intake.undelivered == 0 and state.batches["echo"].undelivered == 0
    assert held_models(r, keys) == {}
    # the export: the job's Parquet file, its record exported (mark_exported touches the job's slot)
    from batchinfer.jobs.export import export_job

    monkeypatch.setenv("BATCHINFER_PARTITIONS", str(PARTITIONS))
    monkeypatch.setenv("BATCHINFER_RESULTS_ROOT", str(tmp_path))
    export_job(jobs[1], prefix="{cl}", redis_url=cluster.url)
    record = JobStore(r, keys).get(jobs[1])
    assert record is not None and record.status is JobStatus.COMPLETED and record.done == 30
    assert sorted(pq.read_table(record.output).column("idx").to_pylist()) == list(range(30))
    assert not r.sismember(keys.for_job(jobs[1]).cancelled, jobs[1])
    listed = [rec.id for rec in JobStore(r, keys).list(limit=10)]
    assert set(listed) == {*jobs, late}


def test_the_http_api_serves_sync_requests_and_batches_on_a_cluster(cluster, redis_server, tiny_llama,
                                                                    tmp_path):
    """The HTTP API on a cluster over three partitions (its asyncio client too), rq beside it."""
    from api_stack import ApiStack, serve_sync_and_batch

    stack = ApiStack(cluster.url, tmp_path / "api", tiny_llama,
                     env={"BATCHINFER_PARTITIONS": str(PARTITIONS), "BATCHINFER_REDIS_CLUSTER": "1",
                          "BATCHINFER_RQ_REDIS_URL": redis_server.url})
    try:
        assert in_cluster(stack.client.redis)  # detected: the Stack's client names no mode
        serve_sync_and_batch(stack)
    finally:
        stack.close()


def test_doctor_reads_the_cluster_and_asks_for_rq_s_own_redis(cluster, redis_server):
    from batchinfer.cli.doctor import run_doctor

    def found(settings: Settings) -> dict[str, str]:
        return {c.name: c.status for c in run_doctor(settings, device="cpu")}

    alone = found(_settings(cluster, "{dr}"))
    assert alone["redis"] == "PASS" and alone["redis cluster"] == "PASS"
    assert alone["rq redis"] == "FAIL"
    beside = found(_settings(cluster, "{dr}", rq_redis_url=redis_server.url))
    assert beside["rq redis"] == "PASS"
    assert "redis cluster" not in found(Settings(redis_url=redis_server.url))  # a plain Redis: no such check
