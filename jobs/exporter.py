"""``batchinfer exporter``: an rq worker (JSON serializer, never pickle) on batchinfer's rq queue.

It runs the jobs of :mod:`batchinfer.jobs` — Parquet / JSONL / OpenAI exports with retries and the
nightly export of direct results — and, with rq's scheduler, moves scheduled and retried jobs onto
the queue when they are due. On start it books the next nightly export (idempotent). SIGTERM is
rq's warm shutdown: the running export finishes, then the process exits 0. When Redis goes away
(or rq's loop ends for any reason but a stop request) the worker is rebuilt after a backoff
instead of exiting.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
from typing import Any

import redis

from batchinfer.config import Settings
from batchinfer.keys import RQ_QUEUE
from batchinfer.redis_conn import Backoff

log = logging.getLogger(__name__)

BACKOFF_START_S, BACKOFF_CAP_S = 1.0, 30.0  # waits before a rebuild: 1, 2, 4, 8, 16, 30 s
# rq's scheduler (a child process that moves retries and the nightly job onto the queue when due)
# dies when Redis goes away, and the worker restarts it only in its maintenance pass, which by
# default runs after an idle dequeue of worker_ttl - 15 = 405 s and at most every 10 minutes: an
# export retry due 10 s after a Redis blip would wait up to 10 minutes. These bound it to ~15 s.
WORKER_TTL_S = 20  # idle dequeues last worker_ttl - 15 s
MAINTENANCE_S = 10  # maintenance (restarting a dead scheduler, cleaning registries) at most this often
PUBSUB_POLL_S = 1.0  # how long an exit may wait for rq's pub/sub thread (see ExporterWorker.subscribe)
# rq logs each maintenance pass at INFO: with MAINTENANCE_S that was a third of the exporter's log
MAINTENANCE_MESSAGES = ("Worker %s: cleaning registries", "Worker %s: cleaning group registries")


class QuietMaintenance(logging.Filter):
    """Drop rq's "cleaning registries" lines below WARNING; every other rq line is kept.

    Shown again with ``--log-level DEBUG`` (as DEBUG-worthy as they are).
    """

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.WARNING or logging.getLogger().isEnabledFor(logging.DEBUG):
            return True
        return not (isinstance(record.msg, str) and record.msg.startswith(MAINTENANCE_MESSAGES))


def quiet_rq_maintenance() -> None:
    """Install :class:`QuietMaintenance` on rq's worker logger (once)."""
    rq_log = logging.getLogger("rq.worker")
    if not any(isinstance(f, QuietMaintenance) for f in rq_log.filters):
        rq_log.addFilter(QuietMaintenance())


def build_worker(r: redis.Redis, name: str | None = None):
    """An rq ``Worker`` on :data:`batchinfer.keys.RQ_QUEUE` with the JSON serializer.

    Its ``stop_asked`` tells a stop by signal from rq's loop giving up on its own: rq's
    ``work()`` returns normally after an unexpected error (e.g. Redis gone during a heartbeat),
    and a daemon must then start again instead of exiting 0.
    """
    from rq import Queue, Worker
    from rq.serializers import JSONSerializer

    class ExporterWorker(Worker):
        stop_asked = False

        def request_stop(self, signum, frame):
            self.stop_asked = True
            super().request_stop(signum, frame)

        def subscribe(self) -> None:
            """rq's, but its pub/sub thread polls every PUBSUB_POLL_S instead of 60 s: redis-py 8's
            ``PubSubWorkerThread.stop()`` joins the thread, which after the unsubscribe sits out a
            whole poll, so every exit (a burst run's end, a stop) could hang for up to a minute."""
            self.log.info("Worker %s: subscribing to channel %s", self.name, self.pubsub_channel_name)
            self.pubsub = self.connection.pubsub()
            self.pubsub.subscribe(**{self.pubsub_channel_name: self.handle_payload})
            thread: Any = self.pubsub.run_in_thread(  # Any: rq's stubs type the attribute as None
                sleep_time=PUBSUB_POLL_S, daemon=True, exception_handler=self._pubsub_exception_handler)
            self.pubsub_thread = thread

    queue = Queue(RQ_QUEUE, connection=r, serializer=JSONSerializer)
    return ExporterWorker([queue], connection=r, serializer=JSONSerializer, name=name,
                          worker_ttl=WORKER_TTL_S, maintenance_interval=MAINTENANCE_S)


def main(settings: Settings, *, name: str | None = None, burst: bool = False) -> int:
    """Run the exporter until SIGTERM / SIGINT (or, with ``burst``, until the queue is empty)."""
    name = name or f"exporter-{socket.gethostname()}-{os.getpid()}"
    quiet_rq_maintenance()
    server = _serve_health(settings)
    try:
        return _run(settings, name, burst)
    finally:
        if server is not None:
            server.stop()


def _serve_health(settings: Settings):
    """`/metrics` (process metrics), `/healthz`, `/readyz` (Redis reachable) on `--metrics-port`
    (and `--metrics-host`)."""
    if settings.metrics_port is None:
        return None
    from prometheus_client import CollectorRegistry, ProcessCollector

    from batchinfer.ops.httpserver import Readiness, serve

    registry = CollectorRegistry()
    ProcessCollector(registry=registry)
    readiness = Readiness()
    # its own connection with a timeout: a hung Redis must not hang the probe
    readiness.add_probe("redis", settings.connect(socket_timeout=5).ping)
    return serve(settings.metrics_port, registry, readiness, settings.metrics_host)


def _run(settings: Settings, name: str, burst: bool) -> int:
    from batchinfer.jobs.nightly import schedule_nightly

    stopping = threading.Event()
    # never reset: work() only returns on a failure, so a success is never seen (attempt names the worker)
    attempt, backoff = 0, Backoff(BACKOFF_START_S, BACKOFF_CAP_S)
    while not stopping.is_set():
        try:
            r = settings.connect_rq()  # rq's Redis: the data Redis unless BATCHINFER_RQ_REDIS_URL
            schedule_nightly(r, settings)
            worker = build_worker(r, name=f"{name}-{attempt}" if attempt else name)
            # rq installs its own SIGTERM / SIGINT handlers (warm shutdown) inside work().
            log.info("exporter %s on queue %s (%s)", worker.name, RQ_QUEUE,
                     settings.redacted_url() or "default Redis")
            worker.work(burst=burst, with_scheduler=True, logging_level=settings.log_level)
            if burst or worker.stop_asked:
                return 0
            reason = "rq's worker loop gave up (the error is logged above)"
        except (redis.ConnectionError, redis.TimeoutError) as e:
            if stopping.is_set():
                return 0
            reason = f"lost Redis ({e})"
        delay = backoff.next()
        attempt += 1
        log.warning("exporter: %s; starting again in %gs", reason, delay)
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
