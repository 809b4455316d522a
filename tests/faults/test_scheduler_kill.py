"""Fault 2: the scheduler SIGKILLed mid-job (three times, at different stages) and restarted."""

from __future__ import annotations

import pytest
from daemons import assert_exactly_once, attempts, dead_letters, start_echo_job

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

N = 200


def test_scheduler_killed_mid_job_and_restarted(redis_server, stacks):
    stack = stacks(redis_server.url)
    job = start_echo_job(stack, N, scheduler="scheduler-0")
    client = stack.client
    # Kill 1: right after submission (intake and staging in progress); 2 and 3: while batches are
    # dispatched and running. Most requests wait in staging the whole time (backpressure).
    for k, rows_before in enumerate((0, N // 4, N // 2)):
        stack.until(lambda n=rows_before: client.status(job).done >= n, 60, f"{rows_before} rows")
        stack.kill(f"scheduler-{k}")
        stack.start(f"scheduler-{k + 1}", "scheduler")

    record = stack.wait(job, timeout=120)
    assert record.status.value == "completed", (record, stack.logs())
    rows = assert_exactly_once(stack, job, N, record)
    assert all(r["status"] == "completed" for r in rows)
    assert [r["custom_id"] for r in sorted(rows, key=lambda r: r["idx"])] == [f"r{i}" for i in range(N)]
    assert record.completed == N and record.failed == 0
    # No worker died: no lease expired, nothing was counted as an attempt or dead-lettered.
    assert attempts(stack, job) == {} and dead_letters(stack) == []
    # Nothing left anywhere: intake, staging, batches.
    r, keys = client.redis, client.keys
    assert r.xlen(keys.requests) == 0
    assert r.zcard(keys.queues("echo")) == 0
    assert r.xlen(keys.batches("echo")) == 0
