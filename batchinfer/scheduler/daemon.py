"""The scheduler daemon: intake -> validate -> tokenise -> stage -> pack -> dispatch; leases; jobs.

The loop only loops; each concern is one object (docs/scheduler.md):

- :class:`batchinfer.scheduler.intake.Intake` — the intake group, validation, tokenisation, staging,
  error rows, idempotency, and the holding area for models not served yet; job control entries
  (``op open|close|cancel``) through :class:`batchinfer.scheduler.jobops.JobOps`;
- :class:`batchinfer.scheduler.dispatch.Dispatcher` — backpressure and packing into batches;
- :class:`batchinfer.scheduler.leases.Leases` — expired batch leases: re-dispatch or dead-letter;
- :class:`batchinfer.scheduler.accounting.Accounting` — job expiry and the export safety net;
- :class:`batchinfer.scheduler.accounting.Settler` — rows for what cancelled / expired jobs left where no
  live worker holds it (held requests, unclaimed batches).

Everything the scheduler knows lives in Redis; its memory holds caches and one pass's window.

Any number of schedulers may run against one queue: one of them owns the work
(:class:`batchinfer.store.ownership.Ownership`, a lease in Redis) and makes the passes, the others
stand by and take over within ``scheduler_takeover_seconds`` of the owner's end (docs/scheduler.md,
"Several schedulers").
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable

import redis

from batchinfer.clock import MONOTONIC, WALL_MS, Clock, WallClock
from batchinfer.config import Settings
from batchinfer.keys import Keys
from batchinfer.ops.metrics import SchedulerMetrics
from batchinfer.redis_conn import Backoff
from batchinfer.scheduler.accounting import Accounting, Settler
from batchinfer.scheduler.dispatch import Dispatcher
from batchinfer.scheduler.intake import Admission, Intake
from batchinfer.scheduler.leases import Leases
from batchinfer.scheduler.lookups import JobCache, ModelCache, RowSink
from batchinfer.scheduler.staging import Staging
from batchinfer.store.ownership import NotOwner, Ownership, announce, withdraw
from batchinfer.store.registry import Registry

log = logging.getLogger(__name__)

BACKOFF_START_S, BACKOFF_CAP_S = 0.1, 5.0
STALL_AFTER_S = 300.0  # /healthz fails when a pass has not finished for this long


class Periodic:
    """``due()`` is True at most once every ``period`` seconds of ``clock``."""

    def __init__(self, period: float, clock: Clock = MONOTONIC):
        self.period, self.last, self.clock = period, float("-inf"), clock

    def due(self) -> bool:
        now = self.clock()
        if now - self.last < self.period:
            return False
        self.last = now
        return True


class SchedulerDaemon:
    """One scheduler process. ``run(stop)`` serves; ``run_once()`` is one pass (tests call it)."""

    def __init__(self, r: redis.Redis, settings: Settings, *, name: str = "scheduler",
                 metrics: SchedulerMetrics | None = None, block_ms: int = 200,
                 direct_hold_s: float | None = None, clock: Clock = MONOTONIC,
                 wall_clock: WallClock = WALL_MS, instance: str | None = None):
        """``direct_hold_s``: how long a direct request for an unserved model is held (default
        ``settings.direct_hold_seconds``, ``BATCHINFER_DIRECT_HOLD_SECONDS``). ``clock`` times the
        periodic sweeps; ``wall_clock`` decides holds, job expiry and ``results:direct``'s retention.
        ``instance`` names this scheduler in the ownership (default: host and pid)."""
        self.redis, self.settings, self.name, self.block_ms = r, settings, name, block_ms
        self.metrics = metrics
        self.keys = keys = Keys(settings.prefix)
        self.ownership = Ownership(r, keys.scheduler_owner, keys.scheduler_epoch, name=instance,
                                   takeover_seconds=settings.scheduler_takeover_seconds)
        registry = Registry(r, keys)
        jobs, models, staging = JobCache(r, keys), ModelCache(registry), Staging(r, keys)
        self.sink = RowSink(r, settings, keys, metrics, clock=wall_clock)
        self.admission = Admission(r, keys, settings, jobs, models, direct_hold_s=direct_hold_s,
                                   clock=wall_clock)
        fence = self.ownership
        self.intake = Intake(r, keys, self.admission, staging, self.sink, consumer=name, fence=fence)
        self.dispatcher = Dispatcher(r, keys, registry, models, staging, jobs, self.sink, fence, metrics)
        self.leases = Leases(r, keys, settings, registry, jobs, self.sink, consumer=name, fence=fence)
        self.accounting = Accounting(r, keys, settings, jobs, self.sink, clock=wall_clock)
        self.settler = Settler(r, keys, registry, jobs, self.sink, self.intake)
        # the intake's pending entries are re-read every takeover time: a scheduler that lost the
        # ownership in the middle of a pass may have read (never settled) entries under the shared name
        self.timers = {"recover": Periodic(settings.scheduler_takeover_seconds, clock),
                       "announce": Periodic(min(1.0, settings.scheduler_takeover_seconds / 3)),
                       "leases": Periodic(max(0.05, settings.lease_seconds / 4), clock),
                       "held": Periodic(2.0, clock), "accounting": Periodic(1.0, clock)}
        self._ready = False
        self._held_releasing = False  # the last held sweep released requests: sweep again next pass

    def run_once(self, block_ms: int | None = None) -> int:
        """One pass over every concern if this scheduler is the owner (taking the ownership when it
        is free); returns how much work it found (0: idle, or standing by)."""
        was_owner = self.ownership.held
        owner = self.ownership.tick()
        if self.metrics is not None:
            self.metrics.set_owner(owner, taken=owner and not was_owner)
        if not owner:
            return 0
        if not was_owner:  # taken over: what a predecessor left half done is read again
            self._reset()
        try:
            return self._pass(block_ms)
        except (NotOwner, redis.WatchError) as e:  # another scheduler took over: its transactions won
            self.ownership.lost(type(e).__name__)
            self._reset()
            return 0

    def _pass(self, block_ms: int | None) -> int:
        if not self._ready:
            self.intake.ensure_group()
            self._ready = True
        if self.timers["recover"].due():
            self.intake.recovered = False
        work = self.intake.step(block_ms)
        work += self.dispatcher.step()
        if self.timers["leases"].due():
            work += self.leases.step()
        # Held requests are re-decided every 2 s, 500 at a time; while a sweep releases some (their
        # model is served now, e.g. a worker registered after the job was submitted) the next pass
        # sweeps again, so a held backlog drains at the scheduler's speed, not 250 requests/s.
        if self._held_releasing or self.timers["held"].due():
            released = self.intake.sweep_held()
            self._held_releasing = released > 0
            work += released
        if self.timers["accounting"].due():
            work += self.accounting.step() + self.settler.step()  # expire, then settle what no worker holds
        return work

    def _reset(self) -> None:
        """After an error: re-create the groups, re-read own pending intake entries."""
        self._ready = self.intake.recovered = False
        self.dispatcher.grouped.clear()

    def run(self, stop: threading.Event, tick: Callable[[], None] | None = None) -> None:
        """Serve until ``stop`` is set; Redis outages are waited out with backoff.

        ``tick`` is called after every pass (the health server's liveness).
        """
        log.info("scheduler %s: serving prefix %s (lease %g s, max attempts %d)", self.name,
                 self.settings.prefix, self.settings.lease_seconds, self.settings.max_attempts)
        backoff, busy = Backoff(BACKOFF_START_S, BACKOFF_CAP_S), False
        standby_wait = min(1.0, self.settings.scheduler_takeover_seconds / 3)
        renewing = threading.Event()  # its own: the loop's waits are on ``stop`` alone
        renewal = self.ownership.renew_while(renewing)  # a long pass keeps the ownership
        while not stop.is_set():
            try:
                busy = self.run_once(block_ms=None if busy else self.block_ms) > 0
                if self.timers["announce"].due():
                    announce(self.redis, self.keys.schedulers, self.ownership)
                backoff.reset()
                if tick is not None:
                    tick()
                if not self.ownership.held:
                    stop.wait(standby_wait)  # another scheduler owns the work: look again soon
            except (redis.ConnectionError, redis.TimeoutError) as e:
                wait = backoff.next()
                log.warning("scheduler: Redis unavailable (%s); retrying in %.1f s", e, wait)
                self._reset()
                stop.wait(wait)
            except Exception:  # a bug in one pass must not end the daemon; log it and go on
                log.exception("scheduler: pass failed; continuing")
                self._reset()
                stop.wait(1.0)
        renewing.set()
        renewal.join(timeout=5)
        try:
            self.ownership.release()  # a standby takes over now, not after the lease runs out
            withdraw(self.redis, self.keys.schedulers, self.ownership)
        except redis.RedisError as e:
            log.warning("scheduler: could not release the ownership (%s); it lapses by itself", e)
        log.info("scheduler %s: stopped", self.name)


def main(settings: Settings) -> int:
    """``batchinfer scheduler``: serve until SIGTERM / SIGINT; returns the exit code."""
    from batchinfer.ops.httpserver import Readiness, serve
    from batchinfer.redis_conn import connect

    stop = threading.Event()

    def on_signal(signum, frame):
        log.info("scheduler: %s received; stopping", signal.Signals(signum).name)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    r = connect(settings.redis_url, settings.redis_ca_file)
    # The scrape-time collector gets its own connection with a timeout: a hung Redis must not hang /metrics.
    scrape = connect(settings.redis_url, settings.redis_ca_file, socket_timeout=5)
    metrics = SchedulerMetrics(redis_client=scrape, keys=Keys(settings.prefix))
    readiness = Readiness(stall_after=STALL_AFTER_S)
    readiness.add_probe("redis", r.ping)
    server = serve(settings.metrics_port, metrics.registry, readiness, settings.metrics_host)
    try:
        SchedulerDaemon(r, settings, metrics=metrics).run(stop, tick=readiness.tick)
    finally:
        if server is not None:
            server.stop()
    return 0
