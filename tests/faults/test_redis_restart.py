"""Fault 3: Redis itself crashes mid-job and comes back from its append-only file.

``appendfsync always``: Redis is SIGKILLed; every write it acknowledged was on disk, nothing is
lost. ``appendfsync everysec``: a crash of the whole machine is simulated — Redis is SIGKILLed
and its append-only file is cut back to its size of one second earlier, which is what a machine
crash loses with ``everysec`` (the writes since the last fsync). What goes is daemon progress of
that second — published rows with their guard bits, acknowledgements, dispatched batches — and
the daemons must redo it (docs/reliability.md, "What a crash of Redis can lose"). The submission
is older than that second. Either way the daemons reconnect with backoff and the job ends with
exactly one row per request.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
from daemons import assert_exactly_once, dead_letters, start_echo_job

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

N = 200
# Longer than redis-py's own retries (6, backing off 0.1 .. 2 s, about 5 s in all), so every
# daemon's loop sees the error and backs off itself; and longer than a lease, so batches are
# taken back and re-run.
OUTAGE_S = 6.0
UNSYNCED_S = 1.0  # what everysec may lose to a machine crash


@pytest.fixture(params=["everysec", "always"])
def aof_redis(redis_server, request):
    """The test's redis-server, restarted on its port with an append-only file."""
    redis_server.stop(kill=True)
    redis_server.extra_args = ["--appendonly", "yes", "--appendfsync", request.param]
    redis_server.start()
    redis_server.fsync = request.param
    return redis_server


class AofTail:
    """Samples the size of Redis' incremental AOF file, to cut it back to an earlier size."""

    def __init__(self, directory: Path):
        self.dir = directory / "appendonlydir"
        self.sizes: list[tuple[float, str, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _file(self) -> Path:
        return max(self.dir.glob("*.incr.aof"), key=lambda p: int(p.name.split(".")[-3]))

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            f = self._file()
            self.sizes.append((time.monotonic(), str(f), f.stat().st_size))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def cut_back(self, seconds: float) -> int:
        """After the crash: drop what was written in the last ``seconds``; returns bytes dropped."""
        self.stop()
        now = time.monotonic()
        last_name = self.sizes[-1][1]
        then = [size for t, name, size in self.sizes if t <= now - seconds and name == last_name]
        keep = then[-1] if then else 0
        dropped = os.path.getsize(last_name) - keep
        os.truncate(last_name, keep)
        return dropped


def test_redis_crash_mid_job_with_aof(aof_redis, stacks):
    stack = stacks(aof_redis.url)
    job = start_echo_job(stack, N)
    client = stack.client
    submitted = time.monotonic()
    tail = AofTail(aof_redis.dir)
    stack.until(lambda: client.status(job).done >= N // 4, 60, "a quarter of the rows")
    time.sleep(max(0.0, submitted + 2.5 - time.monotonic()))  # the submission is older than the cut
    rows_before = client.status(job).done

    aof_redis.stop(kill=True)  # a crash: no shutdown, no final fsync
    dropped = tail.cut_back(UNSYNCED_S) if aof_redis.fsync == "everysec" else tail.stop()
    time.sleep(OUTAGE_S)
    stack.check_alive()  # the daemons wait it out
    aof_redis.start()
    if aof_redis.fsync == "everysec":  # the last second really was lost: rows and all
        assert dropped > 0 and client.status(job).done < rows_before, (dropped, rows_before)
    else:
        assert client.status(job).done >= rows_before  # nothing acknowledged was lost

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
