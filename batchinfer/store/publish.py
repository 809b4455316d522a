"""Exactly-once publication of result rows, and the end of a job's submission.

Delivery is at-least-once everywhere (a crashed worker's batch is re-run), so publication is
where duplicates stop: one Lua script sets the request's guard bit only if it was unset, appends
the row to the job's results stream (and ``reply_to``), bumps the job's counters and, when the
last row of an ended submission lands, makes the job final. Exactly one caller learns
``finalizing=True`` and enqueues the export job.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import redis
from redis.exceptions import NoScriptError

from batchinfer.keys import DIRECT, Keys
from batchinfer.protocol.rows import now_ms
from batchinfer.store import scripts
from batchinfer.store.jobstore import JobField

if TYPE_CHECKING:
    from collections.abc import Iterable

DIRECT_GUARD_TTL = 7 * 24 * 3600  # seconds a direct request's guard outlives its publication
NOSCRIPT_RETRIES = 3  # script reloads publish_many tries (each follows a flush of the script cache)


class Row(Protocol):
    """What publishing needs from a ``batchinfer.protocol.rows.ResultRow``."""

    job_id: str | None
    idx: int | None
    request_id: str
    status: str

    def to_json(self) -> str: ...


@dataclass(frozen=True)
class PublishOutcome:
    """``published``: this call wrote the row; ``finalizing``: it also made the job final."""

    published: bool
    finalizing: bool


class Publisher:
    """Publishes result rows exactly once; see docs/protocol.md for the keys it touches."""

    def __init__(self, redis_client: redis.Redis, keys: Keys, direct_guard_ttl: int = DIRECT_GUARD_TTL):
        self.redis = redis_client
        self.keys = keys
        self.direct_guard_ttl = int(direct_guard_ttl)
        # redis-py Script objects use EVALSHA and reload on NOSCRIPT (e.g. after a Redis restart)
        self._publish = scripts.register(redis_client, "publish")
        self._finish = scripts.register(redis_client, "finish_submission")

    def _guard(self, job_id: str | None, request_id: str) -> str:
        return self.keys.published(job_id) if job_id else self.keys.published_direct(request_id)

    def _call(self, row: Row, reply_to: str | None) -> tuple[list[str], list]:
        """KEYS and ARGV of ``publish.lua`` for ``row``."""
        job_id = row.job_id or None
        if job_id is not None and (row.idx is None or row.idx < 0):
            raise ValueError(f"row {row.request_id!r} of job {job_id!r} has no valid idx: {row.idx!r}")
        keys = [self._guard(job_id, row.request_id), self.keys.results(job_id or DIRECT),
                self.keys.job(job_id or DIRECT)]
        if reply_to:
            keys.append(reply_to)
        counter = (JobField.COMPLETED if row.status == "completed" else JobField.FAILED).value
        idx = row.idx if job_id is not None else -1
        return keys, [idx, row.to_json(), counter, now_ms(), self.direct_guard_ttl]

    def publish(self, row: Row, reply_to: str | None = None) -> PublishOutcome:
        """Publish ``row`` unless the same request already has one (one atomic Lua call).

        ``row.status == "completed"`` bumps the job's ``completed`` counter; any other status
        (failed, cancelled, expired) bumps ``failed``. ``reply_to``, when given, receives a copy.
        On Redis Cluster a ``reply_to`` stream must carry the same hash tag as the prefix.
        """
        keys, args = self._call(row, reply_to)
        published, finalizing = self._publish(keys=keys, args=args)
        return PublishOutcome(bool(published), bool(finalizing))

    def publish_many(self, items: Iterable[tuple[Row, str | None]]) -> list[PublishOutcome]:
        """``publish`` for many ``(row, reply_to)`` pairs in one round trip; outcomes in the same order.

        One non-transactional pipeline of EVALSHA calls: each call is still atomic on its own, so a
        request that appears twice (in this call or an earlier one) is published once. When Redis
        lost its script cache (a restart, ``SCRIPT FLUSH``), the script is loaded again and only
        the calls that got NOSCRIPT are sent again: the others ran, and their outcomes (notably
        ``finalizing``, which exactly one call ever sees) must not be lost to a blind re-run.
        """
        calls = [self._call(row, reply_to) for row, reply_to in items]
        outcomes: list[PublishOutcome | None] = [None] * len(calls)
        todo = list(range(len(calls)))
        for _ in range(NOSCRIPT_RETRIES + 1):
            if not todo:
                break
            pipe = self.redis.pipeline(transaction=False)
            for i in todo:
                keys, args = calls[i]
                pipe.evalsha(self._publish.sha, len(keys), *keys, *args)
            missing = []
            for i, reply in zip(todo, pipe.execute(raise_on_error=False), strict=True):
                if isinstance(reply, NoScriptError):
                    missing.append(i)
                elif isinstance(reply, Exception):
                    raise reply
                else:
                    outcomes[i] = PublishOutcome(bool(reply[0]), bool(reply[1]))
            if missing:
                self.redis.script_load(self._publish.script)
            todo = missing
        if todo:
            raise NoScriptError(f"publish script still missing after {NOSCRIPT_RETRIES} reloads")
        return outcomes  # type: ignore[return-value]  # every slot is filled once todo is empty

    def finish_submission(self, job_id: str, total: int) -> bool:
        """Record that job ``job_id`` has ``total`` requests; ``validating`` -> ``in_progress``.

        Returns True when this call made the job final (every row was already published): the
        caller then enqueues the export. Raises KeyError for a job that does not exist.
        """
        if total < 0:
            raise ValueError(f"total must be >= 0, got {total}")
        result = self._finish(keys=[self.keys.job(job_id)], args=[total, now_ms()])
        if result == -1:
            raise KeyError(f"job {job_id!r} does not exist")
        return bool(result)

    def is_published(self, job_id: str | None, idx: int | None, request_id: str | None = None) -> bool:
        """Whether request ``idx`` of ``job_id`` (or the direct request ``request_id``) has its row."""
        return self.published_mask([(job_id, idx, request_id)])[0]

    def published_mask(self, requests: Iterable[tuple[str | None, int | None, str | None]]) -> list[bool]:
        """``is_published`` for many ``(job_id, idx, request_id)`` triples in one round trip."""
        pipe = self.redis.pipeline(transaction=False)
        n = 0
        for job_id, idx, request_id in requests:
            if job_id:
                if idx is None or idx < 0:
                    raise ValueError(f"request of job {job_id!r} has no valid idx: {idx!r}")
                pipe.getbit(self.keys.published(job_id), idx)
            elif request_id:
                pipe.exists(self.keys.published_direct(request_id))
            else:
                raise ValueError("a direct request needs its request_id")
            n += 1
        return [bool(v) for v in pipe.execute()] if n else []
