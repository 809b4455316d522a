"""``batchinfer exporter``: an rq worker (JSON serializer, never pickle) on batchinfer's rq queue.

It runs the jobs of :mod:`batchinfer.jobs` — Parquet / JSONL / OpenAI exports with retries and the
nightly export of direct results — and, with rq's scheduler, moves scheduled and retried jobs onto
the queue when they are due. On start it books the next nightly export (idempotent). SIGTERM is
rq's warm shutdown: the running export finishes, then the process exits 0. When Redis goes away
the worker is rebuilt after a backoff instead of exiting.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time

import redis

from batchinfer.config import Settings
from batchinfer.keys import RQ_QUEUE

log = logging.getLogger(__name__)

BACKOFF_S = (1, 2, 5, 10, 30)


def build_worker(r: redis.Redis, name: str | None = None):
    """An rq ``Worker`` on :data:`batchinfer.keys.RQ_QUEUE` with the JSON serializer."""
    from rq import Queue, Worker
    from rq.serializers import JSONSerializer

    queue = Queue(RQ_QUEUE, connection=r, serializer=JSONSerializer)
    return Worker([queue], connection=r, serializer=JSONSerializer, name=name)


def main(settings: Settings, *, name: str | None = None, burst: bool = False) -> int:
    """Run the exporter until SIGTERM / SIGINT (or, with ``burst``, until the queue is empty)."""
    from batchinfer.jobs.nightly import schedule_nightly
    from batchinfer.redis_conn import connect

    name = name or f"exporter-{socket.gethostname()}-{os.getpid()}"
    stopping = threading.Event()
    attempt = 0
    while not stopping.is_set():
        try:
            r = connect(settings.redis_url, settings.redis_ca_file)
            schedule_nightly(r, settings)
            worker = build_worker(r, name=f"{name}-{attempt}" if attempt else name)
            # rq installs its own SIGTERM / SIGINT handlers (warm shutdown) inside work().
            log.info("exporter %s on queue %s (%s)", worker.name, RQ_QUEUE,
                     settings.redacted_url() or "default Redis")
            worker.work(burst=burst, with_scheduler=True, logging_level=settings.log_level)
            return 0
        except (redis.ConnectionError, redis.TimeoutError) as e:
            if stopping.is_set():
                return 0
            delay = BACKOFF_S[min(attempt, len(BACKOFF_S) - 1)]
            attempt += 1
            log.warning("exporter lost Redis (%s); retrying in %ss", e, delay)
            _sleep_unless_stopped(delay, stopping)
    return 0


def _sleep_unless_stopped(seconds: float, stopping: threading.Event) -> None:
    """Sleep, but let SIGTERM / SIGINT during the backoff end the process cleanly."""
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}

    def stop(signum, frame):
        stopping.set()

    for sig in previous:
        signal.signal(sig, stop)
    try:
        deadline = time.monotonic() + seconds
        while not stopping.is_set() and time.monotonic() < deadline:
            stopping.wait(0.2)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
