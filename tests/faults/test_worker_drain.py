"""Fault 5: SIGTERM to a worker (the tiny model) mid-job: it drains, exits 0, and nothing re-runs.

Draining means: stop pulling, finish every request it holds (running and prefetched), publish,
acknowledge, unregister. So no lease expires, no attempt is counted, nothing is dead-lettered,
and every request it held at SIGTERM has its one row from it; an echo worker serving the same
model finishes the rest of the job.
"""

from __future__ import annotations

import signal

import pytest
from daemons import assert_exactly_once, attempts, dead_letters, pending_of, requests_in

from batchinfer.store.registry import Registry

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

N = 80
TOKENS = 48
MODEL = "tiny-llama"


def test_sigterm_drains_the_worker_and_nothing_reruns(redis_server, stacks, tiny_llama):
    # A long lease: a lease must not expire here, even on a busy machine.
    stack = stacks(redis_server.url, BATCHINFER_LEASE_SECONDS="15")
    stack.start("scheduler", "scheduler")
    stack.start("exporter", "exporter")
    stack.worker("tiny", tiny_llama, options={"max_num_seqs": 8})
    stack.worker("echo", tiny_llama, echo=True, options={"step_delay": 0.05, "requests_per_step": 2,
                                                         "max_num_seqs": 8})
    stack.wait_for_workers(2)
    client = stack.client
    # Enough tokens per request that "tiny" holds batches for seconds, not one poll's time: with 8 a
    # fast machine finished the job between two polls and the test waited for a moment that had passed.
    job = client.submit([{"custom_id": f"r{i}", "prompt": f"The request number {i}", "max_tokens": TOKENS,
                          "min_tokens": TOKENS, "ignore_eos": True, "temperature": 0} for i in range(N)],
                        model=MODEL)

    def tiny_mid_batch() -> list[dict]:
        """The requests of the batches "tiny" holds, once it has published a row and holds some."""
        if not any(r["worker"] == "tiny" for r in client.result_rows(job)):
            return []
        return requests_in(stack, MODEL, pending_of(stack, MODEL, "tiny"))

    held = stack.until(tiny_mid_batch, 120, "the tiny-model worker mid-batch")  # it must finish these
    stack.send("tiny", signal.SIGTERM)
    registry = Registry(client.redis, client.keys)
    stack.until(lambda: all(w.info.get("state") == "draining" for w in registry.live_workers()
                            if w.name == "tiny"), 30, "tiny draining")
    assert stack.wait_exit("tiny", timeout=90) == 0, stack.logs()

    record = stack.wait(job, timeout=120)
    assert record.status.value == "completed", (record, stack.logs())
    rows = {r["idx"]: r for r in assert_exactly_once(stack, job, N, record)}
    assert all(r["status"] == "completed" and r["completion_tokens"] == TOKENS for r in rows.values())
    assert {rows[q["idx"]]["worker"] for q in held} <= {"tiny"}, "a request it held ran elsewhere"
    assert {r["worker"] for r in rows.values()} == {"tiny", "echo"}
    # Nothing re-ran: no lease expired, no attempt counted, nothing dead-lettered.
    assert attempts(stack, job) == {} and dead_letters(stack) == []
    assert pending_of(stack, MODEL, "tiny") == []
    assert "tiny" not in {w.name for w in registry.live_workers()}  # it unregistered
    assert "lease of batch" not in (stack.tmp / "scheduler.log").read_text()
