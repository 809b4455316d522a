"""Several schedulers (issue 32): the owner SIGKILLed mid-job, then the next owner SIGSTOPped past
the takeover time and resumed. A standby takes over each time within the takeover time (2 s here);
the resumed scheduler finds its ownership gone, writes nothing and stands by; every line gets
exactly one row, and nothing runs twice (no worker died, so no attempt is counted)."""

from __future__ import annotations

import signal
import time

import pytest
from daemons import assert_exactly_once, attempts, dead_letters, start_echo_job

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

N = 300
TAKEOVER_S = 2.0  # FAULT_ENV's BATCHINFER_SCHEDULER_TAKEOVER_SECONDS
SLACK_S = 4.0  # a standby looks every third of the takeover time; a loaded machine adds its delay


def owner_pid(stack) -> int | None:
    token = stack.client.redis.get(stack.client.keys.scheduler_owner)
    return int(token.decode().split(":")[1]) if token else None  # host:pid:random


def owner_name(stack) -> str | None:
    pid = owner_pid(stack)
    return next((name for name, proc in stack.procs.items() if proc.pid == pid), None)


def test_schedulers_take_over_from_a_killed_and_a_paused_owner(redis_server, stacks):
    stack = stacks(redis_server.url)
    job = start_echo_job(stack, N, scheduler="s1")  # s1 owns the queue; two echo workers
    stack.start("s2", "scheduler")
    stack.start("s3", "scheduler")
    client = stack.client
    stack.until(lambda: client.status(job).done >= N // 5, 60, "a fifth of the rows")
    first = owner_name(stack)
    assert first == "s1", (first, stack.logs())

    killed_at = time.monotonic()
    stack.kill("s1")
    second = stack.until(lambda: owner_name(stack) in ("s2", "s3") and owner_name(stack),
                         TAKEOVER_S + SLACK_S, "a standby to take over from the killed owner")
    took = time.monotonic() - killed_at
    stack.until(lambda: client.status(job).done >= N // 2, 60, "half the rows")

    stack.send(second, signal.SIGSTOP)
    stopped_at = time.monotonic()
    third = stack.until(lambda: owner_name(stack) not in (None, second) and owner_name(stack),
                        TAKEOVER_S + SLACK_S, "the last standby to take over from the paused owner")
    took_paused = time.monotonic() - stopped_at
    time.sleep(1.0)
    stack.send(second, signal.SIGCONT)  # it wakes up holding a stale token

    record = stack.wait(job, timeout=150)
    assert record.status.value == "completed", (record, stack.logs())
    rows = assert_exactly_once(stack, job, N, record)
    assert all(r["status"] == "completed" for r in rows)
    assert attempts(stack, job) == {} and dead_letters(stack) == []  # nothing ran twice
    assert owner_name(stack) == third  # the resumed scheduler did not take the ownership back
    stack.until(lambda: "no longer the owner" in (stack.tmp / f"{second}.log").read_text(), 10,
                f"{second} to notice it lost the ownership")
    assert took <= TAKEOVER_S + SLACK_S and took_paused <= TAKEOVER_S + SLACK_S, (took, took_paused)
    stack.check_alive()
