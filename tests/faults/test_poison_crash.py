"""Fault 8: a request that kills its worker process each time it runs (a poison input that faults
the device), with a supervisor that replaces every dead worker.

Each crash returns the dead worker's batches through their leases and counts an attempt for every
request in them. On their last attempt requests run alone (``solo`` batches), so the third crash
takes only the poison request: it is dead-lettered and every request that shared its batches
completes. Before solo batches, the requests still in its batch at the third crash were
dead-lettered with it.
"""

from __future__ import annotations

import json
import time

import pytest
from daemons import SLOW_ECHO, assert_exactly_once, attempts, dead_letters, poison_stack, submit_poison_job
from faulty_echo import POISON_EXIT_CODE

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

N = 12
POISON_IDX = 5
MAX_ATTEMPTS = 3


def test_a_request_that_kills_its_worker_is_dead_lettered_alone(redis_server, stacks):
    stack = poison_stack(stacks, redis_server.url, MAX_ATTEMPTS)
    options = {**SLOW_ECHO, "poison": "POISON", "poison_exit": "true"}
    stack.worker("w0", echo=True, options=options)
    stack.wait_for_worker("w0")
    job, prompts = submit_poison_job(stack, N, POISON_IDX)

    # The supervisor (systemd, Kubernetes): a worker that dies is replaced under a new name.
    crashes, deadline = 0, time.monotonic() + 150
    while not stack.client.status(job).terminal:
        assert time.monotonic() < deadline, f"job not done after {crashes} crash(es)\n{stack.logs()}"
        current = f"w{crashes}"
        if stack.procs[current].poll() is not None:
            assert stack.wait_exit(current) == POISON_EXIT_CODE, stack.logs()
            crashes += 1
            stack.worker(f"w{crashes}", echo=True, options=options)
        time.sleep(0.05)

    record = stack.wait(job)
    rows = {r["idx"]: r for r in assert_exactly_once(stack, job, N, record)}
    poison = rows[POISON_IDX]
    assert (poison["status"], poison["error_code"]) == ("failed", "dead_lettered"), poison
    assert all(rows[i]["status"] == "completed" for i in range(N) if i != POISON_IDX), stack.logs()
    assert all(rows[i]["output_text"] == prompts[i][:4] for i in range(N) if i != POISON_IDX)
    assert (record.completed, record.failed) == (N - 1, 1)
    # The poison request ran on each of its attempts, and each run killed a worker.
    assert crashes == MAX_ATTEMPTS
    assert attempts(stack, job)[POISON_IDX] == MAX_ATTEMPTS
    [dead] = dead_letters(stack)
    assert json.loads(dead["request"])["request_id"] == f"{job}:{POISON_IDX}"
    assert stack.client.redis.xlen(stack.client.keys.batches("echo")) == 0
