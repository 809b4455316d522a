"""The exporter's scheduled work (export retries, the nightly export) survives its scheduler
dying and Redis restarting.

rq runs its scheduler as a child process of the exporter. A Redis outage either kills that child
(rq starts it again only in its maintenance pass: by default after an idle dequeue of 405 s, at
most every 10 minutes; the exporter bounds both to seconds) or ends rq's worker loop, which then
returns as if asked to stop (the exporter must build a new one, not exit 0).
"""

from __future__ import annotations

import os
import signal
import time
from datetime import timedelta
from pathlib import Path

import pytest
from rq import Queue
from rq.serializers import JSONSerializer

from batchinfer.jobs.exporter import MAINTENANCE_S, WORKER_TTL_S
from batchinfer.keys import RQ_QUEUE

pytestmark = [pytest.mark.slow, pytest.mark.timeout(150),
              pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="needs Linux /proc")]

OUTAGE_S = 6.0  # past redis-py's own retries: rq's loop and its scheduler see the error
RESTART_BOUND_S = 30  # a dead scheduler is back within an idle dequeue and a maintenance pass


def children(pid: int) -> list[int]:
    """Live child processes of ``pid`` (Linux /proc)."""
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(c) for c in (task / "children").read_text().split()]
    return found


def scheduled_job_runs(stack, r, what: str) -> None:
    queue = Queue(RQ_QUEUE, connection=r, serializer=JSONSerializer)
    job = queue.enqueue_in(timedelta(seconds=1), "json.dumps", [1, 2])  # as an export retry falls due
    stack.until(lambda: job.get_status(refresh=True) == "finished", RESTART_BOUND_S, what)
    assert job.return_value() == "[1, 2]"


def test_scheduled_jobs_run_after_the_rq_scheduler_dies_and_after_a_redis_restart(redis_server, stacks):
    assert WORKER_TTL_S - 15 + MAINTENANCE_S < RESTART_BOUND_S
    stack = stacks(redis_server.url)
    exporter = stack.start("exporter", "exporter")
    log = stack.tmp / "exporter.log"
    stack.until(lambda: "Scheduler for batchinfer started" in log.read_text(), 30, "rq's scheduler")
    r = redis_server.client()

    (scheduler,) = children(exporter.pid)
    os.kill(scheduler, signal.SIGKILL)  # as a Redis error would end it
    scheduled_job_runs(stack, r, "a job scheduled after rq's scheduler died")

    redis_server.stop(kill=True)
    time.sleep(OUTAGE_S)
    redis_server.start()
    scheduled_job_runs(stack, redis_server.client(), "a job scheduled after Redis came back")
    stack.check_alive()  # the exporter never exited
