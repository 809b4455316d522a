"""Fault 3: Redis itself crashes (SIGKILL) mid-job and comes back from its append-only file.

With ``appendfsync always`` nothing acknowledged is lost; with ``everysec`` up to the last second
of writes is (docs/reliability.md): here that is daemon progress only (rows, acks, dispatches
made in that second), which the daemons redo — the submission is older than a second. Either
way the daemons must reconnect with backoff and the job must end with one row per request.
"""

from __future__ import annotations

import time

import pytest
from daemons import SLOW_ECHO, assert_exactly_once, dead_letters

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

N = 200
# Longer than redis-py's own retries (6, backing off 0.1 .. 2 s, about 5 s in all), so every
# daemon's loop sees the error and backs off itself; and longer than a lease, so batches are
# taken back and re-run.
OUTAGE_S = 6.0


@pytest.fixture(params=["everysec", "always"])
def aof_redis(redis_server, request):
    """The test's redis-server, restarted on its port with an append-only file."""
    redis_server.stop(kill=True)
    redis_server.extra_args = ["--appendonly", "yes", "--appendfsync", request.param]
    redis_server.start()
    return redis_server


def test_redis_crash_mid_job_with_aof(aof_redis, stacks):
    stack = stacks(aof_redis.url)
    stack.start("scheduler", "scheduler")
    stack.start("exporter", "exporter")
    for name in ("a", "b"):
        stack.worker(name, echo=True, options=SLOW_ECHO)
    stack.wait_for_workers(2)
    client = stack.client
    job = client.submit([{"custom_id": f"r{i}", "prompt": f"request {i:03d}", "max_tokens": 3}
                         for i in range(N)], model="echo")
    submitted = time.monotonic()
    stack.until(lambda: client.status(job).done >= N // 4, 60, "a quarter of the rows")
    time.sleep(max(0.0, submitted + 2.0 - time.monotonic()))  # everysec: the submission is on disk

    print("KILL", time.time()); aof_redis.stop(kill=True)  # a crash: no shutdown, no final fsync
    time.sleep(OUTAGE_S)
    stack.check_alive()  # the daemons wait it out
    aof_redis.start(); print("STARTED", time.time())

    record = stack.wait(job, timeout=150)
    assert record.status.value == "completed", (record, stack.logs())
    rows = assert_exactly_once(stack, job, N, record)
    assert all(r["status"] == "completed" for r in rows)
    assert record.completed == N and record.failed == 0
    assert dead_letters(stack) == []
    logs = {name: (stack.tmp / f"{name}.log").read_text() for name in ("scheduler", "a", "b")}
    for name, text in logs.items():  # each daemon saw the outage and came back on its own
        assert "Redis unavailable" in text, (name, stack.logs())
    stack.check_alive()
