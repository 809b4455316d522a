"""Redis behind Sentinel (issue 32): the master is killed mid-job and the sentinels promote its
replica; the client, the scheduler, the workers and the exporter follow the promotion through
their ``redis+sentinel://`` URL, and every line gets exactly one row.

Replication is asynchronous, so a failover loses the writes the replica had not received. The
replica's link to the master is cut for a moment before the kill (and what it held is dropped),
so that this window holds the workers' publications and acknowledgements of that moment:

- without replica acks, rows the old master had are missing on the promoted one, and the batches
  acknowledged in the window come back as unacknowledged; their leases expire and they run again
  (``attempts`` counts them): the loss window of docs/reliability.md, recovered by the leases and
  the publication guard;
- with ``BATCHINFER_REPLICA_ACKS=1``, no row counts as published and no batch as acknowledged
  before a replica has it: the workers hold them through the window and send them again to the
  new master, and nothing runs twice.
"""

from __future__ import annotations

import json
import time

import pytest
import redis
from daemons import assert_exactly_once, attempts, dead_letters, start_echo_job
from sentinels import SentinelSet

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

N = 400
WINDOW_S = 1.5  # replication cut before the kill: what the failover loses


def _published(r: redis.Redis, results: str) -> set[int]:
    return {json.loads(fields[b"row"])["idx"] for _, fields in r.xrange(results)}


@pytest.fixture
def sentinel_set(tmp_path):
    topology = SentinelSet(tmp_path / "redis").start()
    yield topology
    topology.stop()


@pytest.mark.parametrize("replica_acks", [1, 0], ids=["replica-acks", "no-replica-acks"])
def test_master_killed_mid_job_fails_over(sentinel_set, stacks, replica_acks):
    # leases outlive the window and the failover (a few seconds, more on a loaded machine): only
    # work that was really lost is run again
    stack = stacks(sentinel_set.url, BATCHINFER_REPLICA_ACKS=str(replica_acks),
                   BATCHINFER_REPLICA_ACK_TIMEOUT_MS="200", BATCHINFER_LEASE_SECONDS="20")
    job = start_echo_job(stack, N)
    client = stack.client
    stack.until(lambda: client.status(job).done >= N // 5, 60, "a fifth of the rows")

    results = client.keys.results(job)
    sentinel_set.cut_replication()
    time.sleep(WINDOW_S)
    on_old = _published(redis.Redis(port=sentinel_set.master.port), results)
    sentinel_set.kill_master()
    sentinel_set.drop_link()
    sentinel_set.wait_promoted()
    if not replica_acks:  # rows the old master had, and the promoted one does not: the window
        # (without acks no worker sends a row twice, and a lost batch runs again only once its
        # lease expires, so none of them is back yet)
        lost = on_old - _published(redis.Redis(port=sentinel_set.replica.port), results)
        assert lost, stack.logs()
    if replica_acks:
        # the promoted master has no replica: nothing written to it counts as done (the workers would
        # hold their last rows and acks, and each stop would wait its drain timeout out) until the old
        # master is back as its replica
        sentinel_set.rejoin_old_master()

    record = stack.wait(job, timeout=200)
    assert record.status.value == "completed", (record, stack.logs())
    rows = assert_exactly_once(stack, job, N, record)
    assert all(r["status"] == "completed" for r in rows)
    assert dead_letters(stack) == []
    ran_again = attempts(stack, job)
    if replica_acks:
        assert ran_again == {}, (ran_again, stack.logs())
        text = "\n".join((stack.tmp / f"{name}.log").read_text() for name in ("a", "b"))
        assert "replica(s) confirmed the write" in text, stack.logs()  # the window was felt, and held
    else:
        assert ran_again, stack.logs()  # batches acked in the window were lost with it, and re-run
    stack.check_alive()
