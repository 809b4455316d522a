"""Fault 6: the network between a worker and Redis is cut for longer than the lease.

Worker "a" reaches Redis through a TCP proxy that the test turns into a black hole (nothing
forwarded, connections left open: a partition). Its lease lapses, the scheduler takes its
batches back, and worker "b" runs them. Then the link comes back: what "a" sent meanwhile (late
rows, acknowledgements, lease refreshes) reaches Redis, and none of it may publish a row twice
or take the batches back.
"""

from __future__ import annotations

import time

import pytest
from daemons import SLOW_ECHO, assert_exactly_once, attempts, dead_letters, pending_of, requests_in

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

N = 120


def test_cut_longer_than_the_lease_moves_the_batch_and_late_results_are_dropped(redis_server, proxy, stacks):
    stack = stacks(redis_server.url)
    stack.start("scheduler", "scheduler")
    stack.start("exporter", "exporter")
    stack.worker("a", echo=True, options=SLOW_ECHO, redis_url=proxy.url())
    stack.worker("b", echo=True, options=SLOW_ECHO)
    stack.wait_for_workers(2)
    client, r = stack.client, stack.client.redis
    job = client.submit([{"custom_id": f"r{i}", "prompt": f"request {i:03d}", "max_tokens": 3}
                         for i in range(N)], model="echo")
    stack.until(lambda: any(x["worker"] == "a" for x in client.result_rows(job))
                and pending_of(stack, "echo", "a"), 60, "worker a mid-batch")

    proxy.cut()
    time.sleep(0.3)  # anything "a" had on the wire before the cut has landed
    held = requests_in(stack, "echo", pending_of(stack, "echo", "a"))
    guard = client.keys.published(job)
    stranded = {q["idx"] for q in held if not r.getbit(guard, q["idx"])}
    assert stranded, "worker a held no unfinished request at the cut"
    # The lease lapses (2 s) and "b" runs the stranded requests while "a" is still cut off.
    stack.until(lambda: all(r.getbit(guard, i) for i in stranded), 60, "b to run a's batch")
    assert pending_of(stack, "echo", "a") == []  # the scheduler took the entries back
    proxy.restore()

    record = stack.wait(job, timeout=120)
    assert record.status.value == "completed", (record, stack.logs())
    rows = {x["idx"]: x for x in assert_exactly_once(stack, job, N, record)}
    assert all(x["status"] == "completed" for x in rows.values())
    assert {rows[i]["worker"] for i in stranded} == {"b"}  # a's late copies were dropped
    assert {i: n for i, n in attempts(stack, job).items() if i in stranded} == {i: 1 for i in stranded}
    assert dead_letters(stack) == []
    # "a" came back and kept serving: alive, registered, holding nothing. Whether it logs "lost the
    # lease" is a race, not a contract: a lease refresh after the restore reports the entries lost,
    # but if a's publisher first sends its late rows (dropped by the guard) and acks, the entries
    # are released as acked and nothing is lost to report.
    stack.wait_for_worker("a", timeout=30)  # fails at once if a daemon died
    assert pending_of(stack, "echo", "a") == []
