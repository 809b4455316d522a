"""Which scheduler does the work: an ownership lease in Redis, and the fence on its writes.

Any number of ``batchinfer scheduler`` processes may run against one queue. Each partition of the
queue (``BATCHINFER_PARTITIONS``, keys.py) has one owner at a time, which does its work (intake,
dispatch, lease sweeps, the held area, job accounting) while the others stand by for it; the
partitions are spread over the live schedulers (:func:`share_of`, :func:`to_release`). The owner
holds ``{p}:scheduler:owner`` (its token: host, pid and a random part) with a time to live of
``takeover_seconds``, renewed every third of that by a thread of its own (so a long pass does not
lose it); a standby takes the key when it is free, so a scheduler that dies or hangs is replaced
within ``takeover_seconds`` (one that stops cleanly gives the key up at once).

Every change of holder bumps ``{p}:scheduler:epoch``, and the owner remembers the epoch it took.
A paused owner (SIGSTOP, a VM freeze) may wake up after a standby took over; it must then write
nothing. Every transaction that moves requests (intake to staging or the held area, staging to a
batch, an expired batch back into new ones) is an :meth:`Ownership.transaction`, which WATCHes the
epoch and checks it before MULTI: a transaction of an older epoch never starts (:class:`NotOwner`),
and EXEC fails (``WatchError``) when the epoch moved in between. Renewals do not touch the epoch,
so they never abort the owner's own transactions; an owner whose lease lapsed while nobody took
over still holds the current epoch, and nobody else writes meanwhile.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import redis

from batchinfer.protocol.rows import now_ms
from batchinfer.store import scripts

log = logging.getLogger(__name__)

FORGET_AFTER_MS = 3600 * 1000  # announcements older than this are removed from the hash


def new_token(label: str | None = None) -> str:
    """A scheduler process's token: its label (default host:pid) and a random part."""
    return f"{label or f'{socket.gethostname()}:{os.getpid()}'}:{uuid.uuid4().hex[:12]}"


def share_of(partitions: int, schedulers: int) -> int:
    """How many of ``partitions`` one of ``schedulers`` live schedulers should own: an even spread
    (the first ones to come get the extra one; a lone scheduler owns them all)."""
    return -(-partitions // max(1, schedulers))


def to_release(held: Collection[int], share: int) -> list[int]:
    """The partitions a scheduler holding ``held`` gives up to come down to ``share`` (its highest
    ones): a scheduler that joins then finds them free."""
    return sorted(held)[share:] if len(held) > share else []


def renew_while(leases: Sequence[Ownership], stop: threading.Event) -> threading.Thread:
    """Renew the held ``leases`` every third of their time on one thread of its own until ``stop``
    (a process's leases of all its partitions: one thread however many): a pass that runs long (a
    large prompt to tokenise) keeps them; only a stuck or paused process loses them. Returns the
    started thread."""
    period = min((lease.ttl_ms for lease in leases), default=1000) / 3000

    def loop() -> None:
        while not stop.wait(period):
            for lease in leases:
                try:
                    if lease.held:
                        lease.tick()
                except redis.RedisError as e:  # the loop's next tick tries again
                    log.debug("scheduler %s: renewal of %s failed (%s)", lease.token, lease.key, e)

    thread = threading.Thread(target=loop, name="ownership-renewal", daemon=True)
    thread.start()
    return thread


class NotOwner(RuntimeError):
    """This scheduler no longer holds the ownership: it must stop writing and stand by."""


class Ownership:
    """The ownership lease at ``key`` (and its epoch counter at ``epoch_key``) as one scheduler
    process sees it."""

    def __init__(self, r: redis.Redis, key: str, epoch_key: str, *, takeover_seconds: float,
                 name: str | None = None, token: str | None = None):
        """``name``: the process's label (default host:pid); ``token``: its unique token (default the
        label and a random part; one process's leases of several partitions share one)."""
        if takeover_seconds <= 0:
            raise ValueError("takeover_seconds (BATCHINFER_SCHEDULER_TAKEOVER_SECONDS) must be > 0, "
                             f"got {takeover_seconds}")
        self.redis, self.key, self.epoch_key = r, key, epoch_key
        self.ttl_ms = max(1, int(takeover_seconds * 1000))
        self.token = token or new_token(name)
        self.label = self.token.rsplit(":", 1)[0]  # an earlier object of this process may hand over
        self.epoch = 0  # the epoch this scheduler took; 0: never held
        self.held = False
        self._renewed_at = float("-inf")  # time.monotonic(): Redis' expiry runs on real time
        self._lock = threading.Lock()  # the loop's tick and the renewal thread
        self._renew = scripts.register(r, "renew_ownership")
        self._release = scripts.register(r, "release_ownership")
        self._claim = scripts.register(r, "take_ownership")

    def tick(self) -> bool:
        """Renew the lease (when a third of its time has passed) or, not holding it, take it if it is
        free; returns whether this scheduler is the owner now. Logs each change."""
        with self._lock:
            now = time.monotonic()
            if self.held and now - self._renewed_at < self.ttl_ms / 3000:
                return True
            kept = self.held and bool(self._renew(keys=[self.key], args=[self.token, self.ttl_ms]))
            if self.held and not kept:
                self._forget("its lease lapsed")
            if not kept:
                kept = self._take()
            if kept:
                self._renewed_at = now
            return kept

    def renew_while(self, stop: threading.Event) -> threading.Thread:
        """:func:`renew_while` for this lease alone."""
        return renew_while([self], stop)

    def _take(self) -> bool:
        # free, or an earlier scheduler object of this process's (a restart within the process)
        epoch = int(self._claim(keys=[self.key, self.epoch_key],
                                args=[self.token, f"{self.label}:", self.ttl_ms]))
        if not epoch:
            return False
        self.held, self.epoch = True, epoch
        log.info("scheduler %s: took the ownership (%s), epoch %d (others take over %g s after it lapses)",
                 self.token, self.key, epoch, self.ttl_ms / 1000)
        return True

    def lost(self, why: str) -> None:
        """Forget the ownership (a fenced transaction failed, or the renewal found another holder)."""
        with self._lock:
            self._forget(why)

    def _forget(self, why: str) -> None:
        if self.held:
            log.warning("scheduler %s: no longer the owner (%s) of %s; standing by (owner now: %s)",
                        self.token, why, self.key, self.owner() or "none")
        self.held = False
        self._renewed_at = float("-inf")

    def owner(self) -> str | None:
        """The current owner's token, if any."""
        value = self.redis.get(self.key)
        return value.decode() if isinstance(value, bytes) else value

    def release(self) -> None:
        """Give the ownership up at once (a clean stop), so a standby need not wait it out."""
        with self._lock:
            if self.held:
                self._release(keys=[self.key], args=[self.token])
                self.held = False

    def transaction(self) -> redis.client.Pipeline:
        """A MULTI pipeline that runs only in this scheduler's epoch: the epoch is WATCHed and checked
        first (:class:`NotOwner` otherwise), and EXEC raises ``WatchError`` if it moved since. Queue
        commands on it and ``execute()`` it as usual. A scheduler that has never held the ownership
        takes it here when it is free; one that held it and was replaced gets :class:`NotOwner`."""
        if not self.epoch and not self.tick():
            raise NotOwner(f"scheduler {self.token}: {self.key} is held by {self.owner() or 'nobody'}")
        pipe = self.redis.pipeline(transaction=True)
        pipe.watch(self.epoch_key)
        current = pipe.get(self.epoch_key)
        if current is None or int(current) != self.epoch:
            pipe.reset()
            raise NotOwner(f"scheduler {self.token}: its epoch {self.epoch} is over (now {current!r})")
        pipe.multi()
        return pipe


# -- who is there: each scheduler announces itself, owner or standby --------------------------------


@dataclass(frozen=True)
class SchedulerView:
    """One scheduler's last announcement (``batchinfer top``)."""

    token: str
    partitions: tuple[int, ...]  # those it owns now (empty: standing by)
    heartbeat_at: int  # ms since the epoch
    takeover_seconds: float

    @property
    def owner(self) -> bool:
        """Whether it owns any partition's work."""
        return bool(self.partitions)

    def live(self, now: int) -> bool:
        """Announced within ``max(3 s, takeover)`` of ``now`` (ms): it announces at least once a second."""
        return now - self.heartbeat_at <= max(3.0, self.takeover_seconds) * 1000


def announce(r: redis.Redis, key: str, token: str, partitions: Sequence[int],
             takeover_seconds: float) -> None:
    """Record that scheduler ``token`` is alive and which partitions it owns (``{p}:schedulers``)."""
    r.hset(key, token, json.dumps({"owner": bool(partitions), "partitions": sorted(partitions),
                                   "heartbeat_at": now_ms(), "takeover_seconds": takeover_seconds}))


def withdraw(r: redis.Redis, key: str, token: str) -> None:
    """A clean stop: scheduler ``token``'s announcement goes."""
    r.hdel(key, token)


def live_schedulers(r: redis.Redis, key: str) -> list[SchedulerView]:
    """The schedulers that announced themselves lately, the owner first; long-silent ones are
    removed from the hash on the way."""
    now = now_ms()
    views, stale = [], []
    for token, raw in r.hgetall(key).items():
        name = token.decode() if isinstance(token, bytes) else str(token)
        try:
            info = json.loads(raw)
            # an announcement without "partitions" (an older scheduler): partition 0 when it owned
            owned = info.get("partitions", [0] if info["owner"] else [])
            view = SchedulerView(name, tuple(int(p) for p in owned), int(info["heartbeat_at"]),
                                 float(info["takeover_seconds"]))
        except (ValueError, KeyError, TypeError):
            stale.append(name)
            continue
        if view.live(now):
            views.append(view)
        elif now - view.heartbeat_at > FORGET_AFTER_MS:
            stale.append(name)
    if stale:
        r.hdel(key, *stale)
    return sorted(views, key=lambda v: (not v.owner, v.partitions, v.token))
