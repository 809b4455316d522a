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
from batchinfer.protocol.rows import now_ms
from batchinfer.redis_conn import Backoff
from batchinfer.scheduler.accounting import Accounting, Settler
from batchinfer.scheduler.dispatch import Dispatcher
from batchinfer.scheduler.intake import Admission, Intake
from batchinfer.scheduler.leases import Leases
from batchinfer.scheduler.lookups import JobCache, ModelCache, RowSink
from batchinfer.scheduler.staging import Staging
from batchinfer.store.ownership import (
    NotOwner,
    Ownership,
    announce,
    live_schedulers,
    new_token,
    renew_while,
    share_of,
    to_release,
    withdraw,
)
from batchinfer.store.registry import Registry, check_partitions

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


class PartitionWork:
    """The scheduler's work on one partition (``keys``' view): its ownership lease, and the passes
    over its intake, staging, batch streams and holding area, and the sweep of its jobs (expiry, the
    export safety net, what cancelled jobs left)."""

    def __init__(self, r: redis.Redis, settings: Settings, keys: Keys, *, name: str, token: str,
                 registry: Registry, jobs: JobCache, models: ModelCache, metrics: SchedulerMetrics | None,
                 direct_hold_s: float | None, clock: Clock, wall_clock: WallClock):
        self.keys = keys
        self.ownership = Ownership(r, keys.scheduler_owner, keys.scheduler_epoch, token=token,
                                   takeover_seconds=settings.scheduler_takeover_seconds)
        staging = Staging(r, keys)
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
                       "leases": Periodic(max(0.05, settings.lease_seconds / 4), clock),
                       "held": Periodic(2.0, clock), "accounting": Periodic(1.0, clock)}
        self._ready = False
        self._held_releasing = False  # the last held sweep released requests: sweep again next pass

    def tick(self) -> bool:
        """Renew (or take, when free) this partition's ownership; True while this scheduler owns it."""
        was_owner = self.ownership.held
        owner = self.ownership.tick()
        if owner and not was_owner:  # taken over: what a predecessor left half done is read again
            self._reset()
        return owner

    def run_once(self, block_ms: int | None) -> int:
        """One pass over every concern of the partition, which this scheduler owns; returns how much
        work it found. Another scheduler's takeover ends the pass (it stands by for this partition)."""
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
        if self.timers["accounting"].due():  # expire, then settle what no worker holds
            work += self.accounting.step() + self.settler.step()
        return work

    def _reset(self) -> None:
        """After an error: re-create the groups, re-read own pending intake entries."""
        self._ready = self.intake.recovered = False
        self.dispatcher.grouped.clear()


class SchedulerDaemon:
    """One scheduler process. ``run(stop)`` serves; ``run_once()`` is one pass (tests call it).

    With P partitions (``BATCHINFER_PARTITIONS``) it holds a :class:`PartitionWork` per partition and
    owns as many as its share (:func:`~batchinfer.store.ownership.share_of` the live schedulers):
    it takes free ones up to its share and gives up those above it, so schedulers that join spread
    the partitions between them and those that stay take over a dead one's. ``intake``,
    ``dispatcher`` and the other parts named here are partition 0's.
    """

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
        self.keys = keys = settings.keys()
        self.token = new_token(instance)
        registry = Registry(r, keys)
        jobs, models = JobCache(r, keys), ModelCache(registry)
        self.parts = [PartitionWork(r, settings, view, name=name, token=self.token, registry=registry,
                                    jobs=jobs, models=models, metrics=metrics, direct_hold_s=direct_hold_s,
                                    clock=clock, wall_clock=wall_clock) for view in keys.parts()]
        first = self.parts[0]
        self.ownership, self.intake, self.dispatcher, self.leases = (first.ownership, first.intake,
                                                                     first.dispatcher, first.leases)
        self.admission, self.sink, self.settler, self.timers = (first.admission, first.sink, first.settler,
                                                                first.timers)
        self.accounting = first.accounting
        self.takeover_s = settings.scheduler_takeover_seconds
        self.spread = Periodic(min(1.0, self.takeover_s / 3))  # announce, count schedulers, rebalance
        self.share = keys.partitions  # of the partitions, how many to own (all, until others are seen)

    def held(self) -> list[int]:
        """The partitions this scheduler owns now."""
        return [p.keys.partition for p in self.parts if p.ownership.held]

    def run_once(self, block_ms: int | None = None) -> int:
        """One pass over every partition this scheduler owns (taking free ones up to its share,
        giving up those above it); returns how much work it found (0: idle, or standing by)."""
        if self.spread.due():
            self._rebalance()
        holding, owned, taken = len(self.held()), [], 0  # a running count: one pass is O(P)
        for part in self.parts:
            had = part.ownership.held
            if not had and holding >= self.share:
                continue  # at its share: free partitions are the others'
            if part.tick():
                owned.append(part)
                taken += not had
                holding += not had
            elif had:  # lost it (its lease lapsed, another took it)
                holding -= 1
        if self.metrics is not None:
            self.metrics.set_owner(len(owned), taken=taken)
        if len(owned) > 1 and block_ms:
            block_ms = max(1, block_ms // len(owned))  # one partition's wait must not stall the others
        return sum(p.run_once(block_ms) for p in owned)

    def _rebalance(self) -> None:
        """Announce this scheduler, learn how many are live, and give up partitions above the share."""
        announce(self.redis, self.keys.schedulers, self.token, self.held(), self.takeover_s)
        if self.keys.partitions == 1:
            return  # one partition: whoever holds it keeps it
        # live for the spread: announced within the takeover time (every live one announces every third
        # of it), so a dead scheduler's share goes to the others about when its leases lapse
        now = now_ms()
        others = sum(1 for s in live_schedulers(self.redis, self.keys.schedulers)
                     if s.token != self.token and now - s.heartbeat_at <= self.takeover_s * 1000)
        self.share = share_of(self.keys.partitions, others + 1)
        for i in to_release(self.held(), self.share):
            log.info("scheduler %s: giving partition %d up (%d scheduler(s) share %d partitions)",
                     self.token, i, others + 1, self.keys.partitions)
            self.parts[i].ownership.release()

    def run(self, stop: threading.Event, tick: Callable[[], None] | None = None) -> None:
        """Serve until ``stop`` is set; Redis outages are waited out with backoff. Raises
        :class:`~batchinfer.store.registry.PartitionsMismatch` when ``BATCHINFER_PARTITIONS`` is not
        the deployment's.

        ``tick`` is called after every pass (the health server's liveness).
        """
        backoff, busy = Backoff(BACKOFF_START_S, BACKOFF_CAP_S), False
        while not stop.is_set():  # PartitionsMismatch ends the daemon: a start-up error
            try:
                check_partitions(self.redis, self.keys)
                break
            except (redis.ConnectionError, redis.TimeoutError) as e:
                log.warning("scheduler: Redis unavailable (%s); retrying", e)
                stop.wait(backoff.next())
        log.info("scheduler %s: serving prefix %s, %d partition(s) (lease %g s, max attempts %d)", self.name,
                 self.settings.prefix, self.keys.partitions, self.settings.lease_seconds,
                 self.settings.max_attempts)
        standby_wait = min(1.0, self.takeover_s / 3)
        renewing = threading.Event()  # its own: the loop's waits are on ``stop`` alone
        renewal = renew_while([p.ownership for p in self.parts], renewing)  # a long pass keeps them
        while not stop.is_set():
            try:
                busy = self.run_once(block_ms=None if busy else self.block_ms) > 0
                backoff.reset()
                if tick is not None:
                    tick()
                if not self.held():
                    stop.wait(standby_wait)  # other schedulers own every partition: look again soon
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
            for p in self.parts:
                p.ownership.release()  # a standby takes over now, not after the lease runs out
            withdraw(self.redis, self.keys.schedulers, self.token)
        except redis.RedisError as e:
            log.warning("scheduler: could not release the ownership (%s); it lapses by itself", e)
        log.info("scheduler %s: stopped", self.name)

    def _reset(self) -> None:
        for p in self.parts:
            p._reset()


def main(settings: Settings) -> int:
    """``batchinfer scheduler``: serve until SIGTERM / SIGINT; returns the exit code."""
    from batchinfer.ops.httpserver import Readiness, serve

    stop = threading.Event()

    def on_signal(signum, frame):
        log.info("scheduler: %s received; stopping", signal.Signals(signum).name)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    r = settings.connect()
    # The scrape-time collector gets its own connection with a timeout: a hung Redis must not hang /metrics.
    scrape = settings.connect(socket_timeout=5)
    metrics = SchedulerMetrics(redis_client=scrape, keys=settings.keys())
    readiness = Readiness(stall_after=STALL_AFTER_S)
    readiness.add_probe("redis", r.ping)
    server = serve(settings.metrics_port, metrics.registry, readiness, settings.metrics_host)
    try:
        SchedulerDaemon(r, settings, metrics=metrics).run(stop, tick=readiness.tick)
    finally:
        if server is not None:
            server.stop()
    return 0
