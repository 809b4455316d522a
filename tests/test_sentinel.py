"""Redis behind Sentinel (issue 32): ``redis+sentinel://`` URLs, clients that follow a failover,
and replica acknowledgements (``BATCHINFER_REPLICA_ACKS``) against a real master, replica and
three sentinels (tests/sentinels.py)."""

from __future__ import annotations

import time

import pytest
import redis
from sentinels import SentinelSet

from batchinfer.config import Settings
from batchinfer.keys import Keys
from batchinfer.protocol.rows import ResultRow
from batchinfer.redis_conn import connect, own_client, parse_sentinel_url, redact_url
from batchinfer.store.jobstore import JobStore
from batchinfer.store.publish import Publisher, ReplicasBehind


@pytest.fixture
def sentinel_set(tmp_path):
    topology = SentinelSet(tmp_path).start()
    yield topology
    topology.stop()


# -- URLs -------------------------------------------------------------------------------------------


def test_a_sentinel_url_names_sentinels_service_database_and_passwords():
    target = parse_sentinel_url("redis+sentinel://app:p%40ss@10.0.0.1:26379,[::1]:5000,s3/main/2"
                                "?sentinel_password=sp")
    assert target.sentinels == (("10.0.0.1", 26379), ("::1", 5000), ("s3", 26379))
    assert (target.service, target.db, target.username, target.password) == ("main", 2, "app", "p@ss")
    assert target.sentinel_password == "sp" and not target.tls
    assert parse_sentinel_url("rediss+sentinel://h:1/main").tls
    assert parse_sentinel_url("redis+sentinel://h:1/main").db == 0


@pytest.mark.parametrize(("url", "message"), [
    ("redis+sentinel:///main", "name at least one sentinel"),
    ("redis+sentinel://h:1", "name the monitored service"),
    ("redis+sentinel://h:1/", "name the monitored service"),
    ("redis+sentinel://h:port/main", "sentinel port must be a number 1-65535, got 'port'"),
    ("redis+sentinel://h:70000/main", "sentinel port must be a number 1-65535"),
    ("redis+sentinel://h:1/main/zero", "the database must be a number, got 'zero'"),
    ("redis+sentinel://h:1/main/0/x", "the path is /SERVICE[/DB]"),
    ("redis+sentinel://h:1/main?master=x", "unknown option 'master'"),
])
def test_a_wrong_sentinel_url_says_what_is_wrong(url, message):
    with pytest.raises(ValueError) as refused:
        connect(url)
    assert str(refused.value).startswith("Redis URL ") and message in str(refused.value)


def test_sentinel_urls_are_redacted():
    shown = redact_url("redis+sentinel://u:secret@h1:1,h2:2/main/0?sentinel_password=other")
    assert shown == "redis+sentinel://u:***@h1:1,h2:2/main/0?sentinel_password=***"
    with pytest.raises(ValueError) as refused:
        connect("redis+sentinel://u:secret@h1:1,h2:x/main")
    assert "secret" not in str(refused.value)


def test_other_schemes_are_still_refused():
    with pytest.raises(ValueError, match="scheme must be one of .*redis\\+sentinel://"):
        connect("memcached://h:1")


# -- a real failover ----------------------------------------------------------------------------------


def test_a_client_follows_the_promotion(sentinel_set):
    r = connect(sentinel_set.url)
    own = own_client(r)  # the worker's threads' own pools: Sentinel-managed too
    r.set("k", "before")
    sentinel_set.wait_synced()
    assert r.connection_pool is not own.connection_pool and own.get("k") == b"before"
    sentinel_set.kill_master()
    sentinel_set.wait_promoted()
    # the next command reconnects through the sentinels, to the promoted replica
    assert r.get("k") == b"before" and own.get("k") == b"before"
    r.set("k", "after")
    assert redis.Redis(port=sentinel_set.replica.port).get("k") == b"after"


def _row(job: str, idx: int) -> ResultRow:
    return ResultRow(job_id=job, request_id=f"{job}:{idx}", status="completed", idx=idx, custom_id=f"c{idx}",
                     model="m", output_text="x", output_token_ids=[1, 2])


def test_replica_acks_hold_a_publication_until_a_replica_has_it(sentinel_set):
    r = connect(sentinel_set.url)
    keys = Keys("{t}")
    job = JobStore(r, keys).create(model="m").id
    publisher = Publisher(r, keys, replica_acks=1, replica_timeout_ms=200)
    assert publisher.publish_many([(_row(job, 0), None)])[0].published  # a live replica: no wait felt

    sentinel_set.pause_replica()
    try:
        began = time.monotonic()
        with pytest.raises(ReplicasBehind) as behind:
            publisher.publish_many([(_row(job, 1), None), (_row(job, 0), None)])
        assert time.monotonic() - began >= 0.2  # it waited the timeout for the replica
        # the outcomes are those of the master, which took the row: the caller keeps them
        assert [o.published for o in behind.value.outcomes] == [True, False]
        assert isinstance(behind.value, redis.ConnectionError)  # every daemon retries it as an outage
        assert "0 of 1 replica(s)" in str(behind.value)
        with pytest.raises(ReplicasBehind):
            publisher.wait_for_replicas()
    finally:
        sentinel_set.resume_replica()
    sentinel_set.wait_synced()
    again = publisher.publish_many([(_row(job, 1), None)])  # the retry: already there, now replicated
    assert [o.published for o in again] == [False]
    assert redis.Redis(port=sentinel_set.replica.port).xlen(keys.results(job)) == 2


def test_replica_acks_are_checked(redis_server):
    r = redis_server.client()
    with pytest.raises(ValueError, match="BATCHINFER_REPLICA_ACKS"):
        Publisher(r, Keys("{t}"), replica_acks=-1)
    with pytest.raises(ValueError, match="BATCHINFER_REPLICA_ACK_TIMEOUT_MS"):
        Publisher(r, Keys("{t}"), replica_acks=1, replica_timeout_ms=0)
    settings = Settings.from_env({"BATCHINFER_REPLICA_ACKS": "1", "BATCHINFER_REPLICA_ACK_TIMEOUT_MS": "250"})
    assert (settings.replica_acks, settings.replica_ack_timeout_ms) == (1, 250)
    # a server with no replica never satisfies one ack
    publisher = Publisher(r, Keys("{t}"), replica_acks=1, replica_timeout_ms=50)
    job = JobStore(r, Keys("{t}")).create(model="m").id
    with pytest.raises(ReplicasBehind):
        publisher.publish(_row(job, 0))



def test_the_api_asyncio_client_follows_the_promotion(sentinel_set):
    import asyncio

    from batchinfer.redis_conn import async_sentinel_client

    async def scenario() -> tuple[bytes | None, bytes | None]:
        client = async_sentinel_client(parse_sentinel_url(sentinel_set.url), {"client_name": "api"})
        await client.set("a", "1")
        sentinel_set.wait_synced()
        sentinel_set.kill_master()
        sentinel_set.wait_promoted()
        after = None
        for _ in range(20):  # the first call may meet the dead master's closed socket
            try:
                after = await client.get("a")
                break
            except redis.ConnectionError:
                await asyncio.sleep(0.1)
        await client.set("b", "2")
        value = await client.get("b")
        await client.aclose()
        return after, value

    assert asyncio.run(scenario()) == (b"1", b"2")
    assert redis.Redis(port=sentinel_set.replica.port).get("b") == b"2"


def test_a_submission_with_replica_acks_returns_once_a_replica_has_it(sentinel_set):
    from batchinfer.client.client import Client

    settings = Settings(redis_url=sentinel_set.url, prefix="{sub}", replica_acks=1,
                        replica_ack_timeout_ms=100)
    client = Client(settings=settings)
    job = client.submit([{"prompt": "a"}, {"prompt": "b"}], model="m")
    replica = redis.Redis(port=sentinel_set.replica.port)
    assert replica.xlen(Keys("{sub}").requests) >= 2  # on the replica when submit returned
    sentinel_set.pause_replica()
    try:
        with pytest.raises(ReplicasBehind, match="is submitted on the master, but a failover now could lose"):
            client.submit([{"prompt": "c"}], model="m")
    finally:
        sentinel_set.resume_replica()
    assert client.status(job).total == 2
