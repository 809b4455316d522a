"""The worker's background thread: batch leases and heartbeats, independent of the engine loop.

A batch stays this worker's while it re-claims its pending entry (``XCLAIM <stream> workers
<name> 0 <id> JUSTID`` resets the entry's idle time; a Lua script does it only for entries this
worker still owns) every ``lease_seconds / 3``; the scheduler re-dispatches entries idle for
longer than ``lease_seconds``. Refreshing from a thread keeps a
batch through a long engine step (a big prefill, a first-step compile).

A wedged main loop must not hold batches forever, though: the loop calls :meth:`tick` every
iteration, and when no tick came for ``stall_seconds`` (default ten leases) the keeper stops
refreshing leases *and* heartbeats, so the scheduler takes the batches back and stops counting
this worker as live. Both resume on the next tick; batches lost meanwhile (claimed by the
scheduler, or already re-dispatched) are reported by :meth:`take_lost`.

Entries are the worker's keys (:mod:`batchinfer.workers.service.streams`): each is refreshed on its own
stream, the model's or an adapter's. A worker serving adapters also reads, each heartbeat, which
adapters the other live workers of its model have loaded (:meth:`resident_elsewhere`, for the
cache-affinity policy :func:`~batchinfer.workers.service.streams.streams_to_read`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import redis

from batchinfer.clock import MONOTONIC, Clock
from batchinfer.keys import WORKERS_GROUP, Keys
from batchinfer.redis_conn import as_text
from batchinfer.store import scripts
from batchinfer.store.registry import Registry
from batchinfer.workers.service.streams import BatchStreams

log = logging.getLogger(__name__)


class Keeper:
    """Refreshes the leases of the batch entries it is told about, and heartbeats the worker."""

    def __init__(self, r: redis.Redis, keys: Keys, *, worker: str, model: str, lease_seconds: float,
                 heartbeat_seconds: float, status: Callable[[], dict[str, Any]],
                 register: Callable[[], None] | None = None, stall_seconds: float | None = None,
                 streams: BatchStreams | None = None, clock: Clock = MONOTONIC):
        """``clock`` times the refreshes, the heartbeats and the stall; the thread waits in real time."""
        self.redis, self.clock = r, clock
        self.streams = streams or BatchStreams(keys, model)
        self.model = model
        self.registry = Registry(r, keys)
        self.worker = worker
        self.lease_interval = max(0.05, lease_seconds / 3)
        self.heartbeat_seconds = heartbeat_seconds
        self.stall_seconds = stall_seconds if stall_seconds is not None else 10 * lease_seconds
        self.status = status
        self.register = register
        self.model_key = keys.model(model)
        self._lock = threading.Lock()
        self._entries: set[str] = set()
        self._lost: set[str] = set()
        self._resident_elsewhere: dict[str, frozenset[str]] = {}  # replaced whole, never mutated
        self._last_tick = self.clock()
        self._stalled = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"keeper-{worker}", daemon=True)
        self._refresh = scripts.register(r, "refresh_leases")  # see lua/refresh_leases.lua

    # -- called by the main loop ------------------------------------------------------------------

    def start(self) -> None:
        self.heartbeat()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def tick(self) -> None:
        """The main loop is alive."""
        self._last_tick = self.clock()

    def hold(self, entry_id: str) -> None:
        with self._lock:
            self._entries.add(entry_id)

    def release(self, entry_ids: list[str]) -> None:
        with self._lock:
            self._entries.difference_update(entry_ids)

    def take_lost(self) -> list[str]:
        """Entries whose lease was taken over since the last call."""
        with self._lock:
            lost, self._lost = sorted(self._lost), set()
            return lost

    def resident_elsewhere(self) -> dict[str, frozenset[str]]:
        """Adapter -> the other live workers of this model that have it loaded, as of the last
        heartbeat (empty for a worker without adapters)."""
        return self._resident_elsewhere

    @property
    def stalled(self) -> bool:
        return self.clock() - self._last_tick > self.stall_seconds

    # -- the thread -------------------------------------------------------------------------------

    def _run(self) -> None:
        next_lease = next_beat = self.clock()
        while not self._stop.wait(max(0.0, min(next_lease, next_beat) - self.clock())):
            now = self.clock()
            if self.stalled:
                if not self._stalled:
                    log.error("worker %s: main loop silent for %.0fs; letting its leases lapse",
                              self.worker, now - self._last_tick)
                self._stalled = True
                next_lease = next_beat = now + self.lease_interval
                continue
            if self._stalled:
                log.warning("worker %s: main loop is back; refreshing leases again", self.worker)
                self._stalled = False
            try:
                if now >= next_lease:
                    self.refresh()
                    next_lease = now + self.lease_interval
                if now >= next_beat:
                    self.heartbeat()
                    next_beat = now + self.heartbeat_seconds
            except redis.RedisError as e:  # Redis away: try again soon, never die
                # a flat retry, not a growing Backoff: waits grown past the lease time would let
                # the leases lapse as soon as Redis is back, and other workers take the batches
                log.warning("worker %s: lease/heartbeat failed (%s); retrying", self.worker, e)
                next_lease = next_beat = now + min(self.lease_interval, 1.0)

    def refresh(self) -> None:
        """Re-claim every held entry this worker still owns; the others are lost."""
        with self._lock:
            entries = sorted(self._entries)
        if not entries:
            return
        kept: set[str] = set()
        for stream, ids in self.streams.by_stream(entries).items():  # one call without adapters
            claimed = self._refresh(keys=[stream], args=[WORKERS_GROUP, self.worker, *ids])
            kept.update(self.streams.key(stream, as_text(c)) for c in claimed)
        with self._lock:
            # Entries released while XCLAIM ran were acked by us, not lost.
            lost = {e for e in entries if e not in kept and e in self._entries}
            self._entries -= lost
            self._lost |= lost
        if lost:
            log.warning("worker %s: lost the lease of %d batch(es): %s", self.worker, len(lost), sorted(lost))

    def heartbeat(self) -> None:
        """Refresh the worker's registration; re-register the model if Redis lost it (a restart)."""
        self.registry.heartbeat_worker(self.worker, self.status(), ttl=3 * self.heartbeat_seconds)
        if self.streams.adapters:
            self._resident_elsewhere = self._read_resident_elsewhere()
        if self.register is not None and not self.redis.exists(self.model_key):
            log.warning("worker %s: model registration missing (Redis restarted?); registering again",
                        self.worker)
            self.register()

    def _read_resident_elsewhere(self) -> dict[str, frozenset[str]]:
        """Which of this worker's adapters the other live workers of its model have loaded."""
        where: dict[str, set[str]] = {}
        served = set(self.streams.adapters)
        for w in self.registry.live_workers(self.model):
            resident = w.info.get("loras_resident")
            if w.name == self.worker or not isinstance(resident, list):
                continue
            for name in served.intersection(n for n in resident if isinstance(n, str)):
                where.setdefault(name, set()).add(w.name)
        return {name: frozenset(names) for name, names in where.items()}
