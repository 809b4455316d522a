"""Fault 1: a worker SIGKILLed mid-batch three times during one job, a replacement started each time."""

from __future__ import annotations

import pytest
from daemons import SLOW_ECHO, assert_exactly_once, attempts, dead_letters, pending_of

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

N = 160


def test_worker_killed_mid_batch_three_times(redis_server, stacks):
    # Up to 3 kills may hit the same request; 5 attempts keep every request completed, so any
    # dead letter below would be a bug, not the attempt limit.
    stack = stacks(redis_server.url, BATCHINFER_MAX_ATTEMPTS="5")
    stack.start("scheduler", "scheduler")
    stack.start("exporter", "exporter")
    stack.worker("w0", echo=True, options=SLOW_ECHO)
    stack.wait_for_worker("w0")
    job = stack.client.submit([{"custom_id": f"r{i}", "prompt": f"request {i:03d}", "max_tokens": 5}
                               for i in range(N)], model="echo")

    def mid_batch(worker: str) -> bool:
        """``worker`` has published a row of this job and holds batches with requests left."""
        done = any(row["worker"] == worker for row in stack.client.result_rows(job))
        return done and bool(pending_of(stack, "echo", worker))

    killed_holding = []
    for k in range(3):
        current = f"w{k}"
        stack.until(lambda w=current: mid_batch(w), 60, f"{current} mid-batch")
        killed_holding.append(pending_of(stack, "echo", current))
        stack.kill(current)
        stack.worker(f"w{k + 1}", echo=True, options=SLOW_ECHO)  # a new name: its batches come back by lease

    record = stack.wait(job, timeout=120)
    assert record.status.value == "completed", (record, stack.logs())
    rows = assert_exactly_once(stack, job, N, record)
    assert all(r["status"] == "completed" for r in rows)
    assert all(r["output_text"] == f"request {r['idx']:03d}"[:5] for r in rows)
    assert record.completed == N and record.failed == 0
    # Every kill left unfinished work behind that came back through a lease: each counted an attempt.
    counted = attempts(stack, job)
    assert all(killed_holding) and counted, counted
    assert max(counted.values()) <= 3
    assert dead_letters(stack) == []
    # The requests that ran on the killed workers and were re-run have their rows from a later worker.
    assert {r["worker"] for r in rows} <= {"w0", "w1", "w2", "w3"}
    assert any(r["worker"] == "w3" for r in rows)
