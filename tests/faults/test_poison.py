"""Fault 4: a poison request that makes the engine raise (the echo engine's ``poison`` hook).

Each failure counts an attempt and sends the request back to the batch stream (it may land on
either worker); at ``max_attempts`` it gets its ``engine_error`` row and a dead letter. The
failing step is bisected, so the requests that shared a step with it complete normally.
"""

from __future__ import annotations

import json

import pytest
from daemons import SLOW_ECHO, assert_exactly_once, attempts, dead_letters, poison_stack, submit_poison_job

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

N = 60
POISON_IDX = 21
MAX_ATTEMPTS = 3


def test_poison_request_is_retried_then_dead_lettered(redis_server, stacks):
    stack = poison_stack(stacks, redis_server.url, MAX_ATTEMPTS)
    options = {**SLOW_ECHO, "poison": "POISON"}
    for name in ("a", "b"):
        stack.worker(name, echo=True, options=options)
    stack.wait_for_workers(2)
    job, prompts = submit_poison_job(stack, N, POISON_IDX)

    record = stack.wait(job, timeout=120)
    assert record.status.value == "completed", (record, stack.logs())  # the job ends; one row failed
    rows = {r["idx"]: r for r in assert_exactly_once(stack, job, N, record)}
    poison = rows[POISON_IDX]
    assert (poison["status"], poison["error_code"], poison["custom_id"]) == ("failed", "engine_error", "r21")
    assert f"{MAX_ATTEMPTS} time(s)" in poison["error_message"] and "POISON" in poison["error_message"]
    assert all(rows[i]["status"] == "completed" for i in range(N) if i != POISON_IDX)
    assert all(rows[i]["output_text"] == prompts[i][:4] for i in range(N) if i != POISON_IDX)
    assert (record.completed, record.failed) == (N - 1, 1)
    # Tried exactly max_attempts times, and given up once.
    assert attempts(stack, job) == {POISON_IDX: MAX_ATTEMPTS}
    [dead] = dead_letters(stack)
    request = json.loads(dead["request"])
    assert (request["request_id"], request["attempts"]) == (f"{job}:{POISON_IDX}", MAX_ATTEMPTS - 1)
    assert "POISON" in dead["error"] and dead["worker"] in ("a", "b")
    # The workers survived it and nothing is left in flight.
    stack.check_alive()
    assert stack.client.redis.xlen(stack.client.keys.batches("echo")) == 0
