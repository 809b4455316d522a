"""Which scheduler does the work: an ownership lease in Redis, and the fence on its writes.

Any number of ``batchinfer scheduler`` processes may run against one queue; one of them, the owner,
does the work (intake, dispatch, lease sweeps, the held area, job accounting) and the others stand
by. The owner holds ``{p}:scheduler:owner`` (its token: host, pid and a random part) with a time to
live of ``takeover_seconds`` and renews it every third of that; a standby takes the key when it is
free, so a scheduler that dies or hangs is replaced within ``takeover_seconds`` (one that stops
cleanly gives the key up at once).

A paused owner (SIGSTOP, a long GC, a VM freeze) may wake up after a standby took over. It must
then write nothing: every transaction that moves requests (intake to staging or the held area,
staging to a batch, an expired batch back into new ones) is a :meth:`Ownership.transaction`, which
WATCHes the key and checks the token before MULTI, so EXEC fails (``WatchError``) when the key
changed hands in between, and no transaction starts without the token (:class:`NotOwner`).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
import uuid
from dataclasses import dataclass

import redis

from batchinfer.protocol.rows import now_ms
from batchinfer.store import scripts

log = logging.getLogger(__name__)

FORGET_AFTER_MS = 3600 * 1000  # announcements older than this are removed from the hash


class NotOwner(RuntimeError):
    """This scheduler no longer holds the ownership: it must stop writing and stand by."""


class Ownership:
    """The ownership lease at ``key`` as seen by one scheduler process."""

    def __init__(self, r: redis.Redis, key: str, *, takeover_seconds: float, name: str | None = None):
        if takeover_seconds <= 0:
            raise ValueError("takeover_seconds (BATCHINFER_SCHEDULER_TAKEOVER_SECONDS) must be > 0, "
                             f"got {takeover_seconds}")
        self.redis, self.key = r, key
        self.ttl_ms = max(1, int(takeover_seconds * 1000))
        self.label = name or f"{socket.gethostname()}:{os.getpid()}"
        self.token = f"{self.label}:{uuid.uuid4().hex[:12]}"
        self._token_bytes = self.token.encode()
        self.held = False
        self._renewed_at = float("-inf")  # time.monotonic(): Redis' expiry runs on real time
        self._renew = scripts.register(r, "renew_ownership")
        self._release = scripts.register(r, "release_ownership")
        self._claim = scripts.register(r, "take_ownership")

    def tick(self) -> bool:
        """Renew the lease (every third of its time) or, not holding it, take it if it is free;
        returns whether this scheduler is the owner now. Logs each change."""
        now = time.monotonic()
        if self.held and now - self._renewed_at < self.ttl_ms / 3000:
            return True
        if self.held:
            kept = bool(self._renew(keys=[self.key], args=[self.token, self.ttl_ms]))
            if not kept:
                self.lost("its lease lapsed")
                kept = self._take()
        else:
            kept = self._take()
        if kept:
            self._renewed_at = now
        return kept

    def _take(self) -> bool:
        # free, or an earlier scheduler object of this process's (a restart within the process)
        if not self._claim(keys=[self.key], args=[self.token, f"{self.label}:", self.ttl_ms]):
            return False
        self.held = True
        log.info("scheduler %s: took the ownership (standbys take over %g s after it lapses)",
                 self.token, self.ttl_ms / 1000)
        return True

    def lost(self, why: str) -> None:
        """Forget the ownership (a fenced transaction failed, or the renewal found another holder)."""
        if self.held:
            log.warning("scheduler %s: no longer the owner (%s); standing by (owner now: %s)",
                        self.token, why, self.owner() or "none")
        self.held = False
        self._renewed_at = float("-inf")

    def owner(self) -> str | None:
        """The current owner's token, if any."""
        value = self.redis.get(self.key)
        return value.decode() if isinstance(value, bytes) else value

    def release(self) -> None:
        """Give the ownership up at once (a clean stop), so a standby need not wait it out."""
        if self.held:
            self._release(keys=[self.key], args=[self.token])
            self.held = False

    def transaction(self) -> redis.client.Pipeline:
        """A MULTI pipeline that runs only while this scheduler is the owner: the key is WATCHed and
        the token checked first (:class:`NotOwner` otherwise), and EXEC raises ``WatchError`` if the
        key changed since. Queue commands on it and ``execute()`` it as usual. A scheduler that does
        not hold the ownership takes it here when it is free; one that held it and finds it gone
        (lapsed while it was paused) does not: it gets :class:`NotOwner` and starts over."""
        if not self.held and not self.tick():  # never held (or let go): take it if it is free
            raise NotOwner(f"scheduler {self.token}: {self.key} is held by {self.owner() or 'nobody'}")
        pipe = self.redis.pipeline(transaction=True)
        pipe.watch(self.key)
        if pipe.get(self.key) not in (self._token_bytes, self.token):
            pipe.reset()
            raise NotOwner(f"scheduler {self.token} does not hold {self.key}")
        pipe.multi()
        return pipe


# -- who is there: each scheduler announces itself, owner or standby --------------------------------


@dataclass(frozen=True)
class SchedulerView:
    """One scheduler's last announcement (``batchinfer top``, ``doctor``)."""

    token: str
    owner: bool
    heartbeat_at: int  # ms since the epoch
    takeover_seconds: float

    def live(self, now_ms: int) -> bool:
        """Announced within the last ``max(3 s, takeover)``: it announces at least once a second."""
        return now_ms - self.heartbeat_at <= max(3.0, self.takeover_seconds) * 1000


def announce(r: redis.Redis, key: str, ownership: Ownership) -> None:
    """Record that this scheduler is alive, and whether it owns the work (``{p}:schedulers``)."""
    r.hset(key, ownership.token, json.dumps({"owner": ownership.held, "heartbeat_at": now_ms(),
                                             "takeover_seconds": ownership.ttl_ms / 1000}))


def withdraw(r: redis.Redis, key: str, ownership: Ownership) -> None:
    """A clean stop: this scheduler's announcement goes."""
    r.hdel(key, ownership.token)


def live_schedulers(r: redis.Redis, key: str) -> list[SchedulerView]:
    """The schedulers that announced themselves lately, the owner first; long-silent ones are
    removed from the hash on the way."""
    now = now_ms()
    views, stale = [], []
    for token, raw in r.hgetall(key).items():
        name = token.decode() if isinstance(token, bytes) else str(token)
        try:
            info = json.loads(raw)
            view = SchedulerView(name, bool(info["owner"]), int(info["heartbeat_at"]),
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
    return sorted(views, key=lambda v: (not v.owner, v.token))
