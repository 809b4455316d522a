"""Exactly-once publication of result rows, and the end of a job's submission.

Delivery is at-least-once everywhere (a crashed worker's batch is re-run), so publication is
where duplicates stop: one Lua script sets the request's guard bit only if it was unset, appends
the row to the job's results stream (and ``reply_to``), bumps the job's counters and, when the
last row of an ended submission lands, makes the job final. Exactly one caller learns
``finalizing=True`` and enqueues the export job.

The same script keeps a copy of the row of a request sent with a ``client_request_id`` and
delivers it to the reply streams of its retries (:class:`Redelivery`, run by the intake on a
duplicate), trims ``results:direct`` to its retention, and skips a ``reply_to`` key that is not a
stream (the row is still published; the skip is logged and counted) instead of failing.

A row of a job that has no record (deleted, or lost by a Redis restart without persistence) is
dropped: nothing is written, so no orphan results stream without a TTL or an export to end it is
ever created. The outcome says so (``dropped``), the drop is counted and logged once per job, and
callers treat the request as settled, so the batch is acknowledged rather than run again forever.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import redis
from redis.exceptions import NoScriptError

from batchinfer.clock import WALL_MS, WallClock
from batchinfer.keys import DIRECT, Keys
from batchinfer.redis_conn import as_text, in_cluster, master_client, moved_or_down
from batchinfer.store import scripts
from batchinfer.store.jobstore import ROW_COUNTERS

if TYPE_CHECKING:
    from collections.abc import Iterable

log = logging.getLogger(__name__)

DIRECT_GUARD_TTL = 7 * 24 * 3600  # seconds a direct request's guard outlives its publication
DIRECT_RETENTION = 7 * 24 * 3600  # seconds results:direct keeps a row (the Settings default)
NOSCRIPT_RETRIES = 3  # script reloads publish_many tries (each follows a flush of the script cache)
GUARD_SPAN_BYTES = 65536  # a job's guard bits read with one GETRANGE when they span fewer bytes
PUBLISH_CHUNK = 256  # rows per publish_rows.lua call: a few ms of Redis' time at most
DROPPED_JOBS_REMEMBERED = 1024  # jobs whose dropped rows were logged already (one warning per job)
NO_JOB = "no_job"  # reason label of a row dropped because its job has no record


class ReplyMetrics(Protocol):
    """What the publisher reports to a daemon's metrics (``batchinfer.ops.metrics``)."""

    def reply_skipped(self, count: int = 1) -> None: ...

    def row_dropped(self, reason: str, count: int = 1) -> None: ...


class Row(Protocol):
    """What publishing needs from a ``batchinfer.protocol.rows.ResultRow``."""

    job_id: str | None
    idx: int | None
    request_id: str
    status: str

    def to_json(self) -> str: ...


class ReplicasBehind(redis.exceptions.ConnectionError):
    """Fewer replicas than asked for (``replica_acks``) confirmed a write within the timeout: the
    write is on the master but could still be lost to a failover, so it does not count as done.
    Raised as a connection error, so every caller retries it with its backoff (publishing and
    acknowledging are idempotent). ``outcomes``: those of the rows just published, in order."""

    def __init__(self, acked: int, wanted: int, timeout_ms: int,
                 outcomes: list[PublishOutcome] | None = None, then: str = "it is retried"):
        super().__init__(f"{acked} of {wanted} replica(s) confirmed the write within {timeout_ms} ms "
                         f"(BATCHINFER_REPLICA_ACKS); {then}")
        self.acked, self.wanted, self.outcomes = acked, wanted, outcomes or []


class RowsFailed(redis.ResponseError):
    """Rows of a :meth:`Publisher.publish_many` call that Redis refused (e.g. WRONGTYPE: a key of
    another type where a row's guard belongs): each failed alone, the call's other rows were
    published. ``outcomes``: every row's, in order, None for those that failed, so the caller acts
    on the others (exports of jobs they made final) before it sends the failed ones again."""

    def __init__(self, message: str, outcomes: list[PublishOutcome | None]):
        super().__init__(message)
        self.outcomes = outcomes


@dataclass(frozen=True)
class PublishOutcome:
    """``published``: this call wrote the row; ``finalizing``: it also made the job final;
    ``skipped``: reply streams (the row's ``reply_to``, a retry's) left unwritten because the key
    holds another type than a stream; ``dropped``: nothing was written because the row's job has no
    record (the request is settled all the same: there is nothing left to publish it to)."""

    published: bool
    finalizing: bool
    skipped: tuple[str, ...] = ()
    dropped: bool = False


class Publisher:
    """Publishes result rows exactly once; see docs/protocol.md for the keys it touches."""

    def __init__(self, redis_client: redis.Redis, keys: Keys, direct_guard_ttl: int = DIRECT_GUARD_TTL, *,
                 direct_retention_s: int = DIRECT_RETENTION, metrics: ReplyMetrics | None = None,
                 clock: WallClock = WALL_MS, replica_acks: int = 0, replica_timeout_ms: int = 1000):
        """``clock``: now, for the job times publication records and ``results:direct``'s retention.
        ``replica_acks`` > 0: each publication waits (``WAIT``, up to ``replica_timeout_ms``) until
        that many replicas have it, else raises :class:`ReplicasBehind` (docs/reliability.md)."""
        if direct_retention_s <= 0:
            raise ValueError(f"direct_retention_s must be > 0 seconds, got {direct_retention_s}")
        if replica_acks < 0:
            raise ValueError(f"replica_acks (BATCHINFER_REPLICA_ACKS) must be >= 0, got {replica_acks}")
        if replica_timeout_ms <= 0:
            raise ValueError("replica_timeout_ms (BATCHINFER_REPLICA_ACK_TIMEOUT_MS) must be > 0, "
                             f"got {replica_timeout_ms}")
        self.replica_acks, self.replica_timeout_ms = int(replica_acks), int(replica_timeout_ms)
        self.redis = redis_client
        self.keys = keys
        self.direct_guard_ttl = int(direct_guard_ttl)
        self.direct_retention_ms = int(direct_retention_s) * 1000
        self.metrics = metrics  # a daemon's: counts reply streams skipped for their type, rows dropped
        self.clock = clock
        self._dropped_jobs: OrderedDict[str, None] = OrderedDict()  # warned of already (bounded)
        self._dropped_lock = threading.Lock()
        # redis-py Script objects use EVALSHA and reload on NOSCRIPT (e.g. after a Redis restart)
        self._publish = scripts.register(redis_client, "publish")
        self._publish_rows = scripts.register(redis_client, "publish_rows")
        self._finish = scripts.register(redis_client, "finish_submission")

    def _guard(self, job_id: str | None, request_id: str) -> str:
        return self.keys.published(job_id) if job_id else self.keys.published_direct(request_id)

    def _call(self, row: Row, reply_to: str | None,
              job_keys: dict[str, tuple[str, str, str]] | None = None) -> tuple[list[str], list]:
        """KEYS of ``publish.lua`` for ``row``, and the row's own ARGV: idx, JSON, counter.
        ``job_keys``: a job's guard, results stream and job hash already named (filled here)."""
        job_id = row.job_id or None
        if job_id is not None and (row.idx is None or row.idx < 0):
            raise ValueError(f"row {row.request_id!r} of job {job_id!r} has no valid idx: {row.idx!r}")
        shared = job_keys.get(job_id) if job_keys is not None and job_id is not None else None
        if shared is None:
            shared = (self._guard(job_id, row.request_id), self.keys.results(job_id or DIRECT),
                      self.keys.job(job_id or DIRECT))
            if job_keys is not None and job_id is not None:
                job_keys[job_id] = shared
        keys = [*shared, self.keys.redelivery(row.request_id, job_id)]
        if reply_to:
            keys.append(reply_to)
        counter = ROW_COUNTERS[row.status].value
        return keys, [row.idx if job_id is not None else -1, row.to_json(), counter]

    def _times(self) -> list[int]:
        """The ARGV every publication shares: now, the direct guard's TTL, results:direct's MINID."""
        now = self.clock()
        return [now, self.direct_guard_ttl, now - self.direct_retention_ms]

    def _outcome(self, row: Row, reply: list) -> PublishOutcome:
        if reply[3]:
            self._dropped(row)
            return PublishOutcome(False, False, dropped=True)
        skipped = tuple(as_text(s) for s in reply[2])
        if skipped:
            # the producer's mistake, not ours: one line, no traceback; the row is in its results stream
            log.warning("request %s: reply stream %s is not a stream (wrong type); row published to %s only",
                        row.request_id, ", ".join(repr(s) for s in skipped),
                        self.keys.results(row.job_id or DIRECT))
            if self.metrics is not None:
                self.metrics.reply_skipped(len(skipped))
        return PublishOutcome(bool(reply[0]), bool(reply[1]), skipped)

    def _dropped(self, row: Row) -> None:
        """Count a row dropped for its job's missing record; warn once per job (a vanished job may
        have thousands of rows still in flight), remembering the last few jobs only."""
        if self.metrics is not None:
            self.metrics.row_dropped(NO_JOB)
        job = str(row.job_id)
        with self._dropped_lock:
            if job in self._dropped_jobs:
                self._dropped_jobs.move_to_end(job)
                return
            self._dropped_jobs[job] = None
            if len(self._dropped_jobs) > DROPPED_JOBS_REMEMBERED:
                self._dropped_jobs.popitem(last=False)
        log.warning("job %s has no record (deleted, or lost by a Redis restart without persistence): "
                    "dropping its rows, starting with request %s (counted in "
                    "batchinfer_rows_dropped_total{reason=\"no_job\"}; further drops of this job not logged)",
                    job, row.request_id)

    def publish(self, row: Row, reply_to: str | None = None) -> PublishOutcome:
        """Publish ``row`` unless the same request already has one (one atomic Lua call).

        The row bumps the job's counter of its status (``completed``, ``failed``, ``cancelled`` or
        ``expired``). ``reply_to``, when given, receives a copy unless the key exists and is not a
        stream (see :class:`PublishOutcome`). A row of a job with no record writes nothing at all
        (``dropped``). On Redis Cluster a ``reply_to`` stream must carry the same hash tag as the
        prefix.
        """
        if self.replica_acks:
            return self.publish_many([(row, reply_to)])[0]
        keys, args = self._call(row, reply_to)
        return self._outcome(row, self._publish(keys=keys, args=[*args, *self._times()]))

    def publish_many(self, items: Iterable[tuple[Row, str | None]]) -> list[PublishOutcome]:
        """``publish`` for many ``(row, reply_to)`` pairs in one round trip; outcomes in the same order.

        One non-transactional pipeline of EVALSHA calls: each call is still atomic on its own, so a
        request that appears twice (in this call or an earlier one) is published once. When Redis
        lost its script cache (a restart, ``SCRIPT FLUSH``), the script is loaded again and only
        the calls that got NOSCRIPT are sent again: the others ran, and their outcomes (notably
        ``finalizing``, which exactly one call ever sees) must not be lost to a blind re-run.

        A row Redis refuses (a key of another type where its guard belongs) fails alone: the others
        are published and :class:`RowsFailed` carries their outcomes.

        With ``replica_acks``, the pipeline ends with ``WAIT``: on the same connection, so it covers
        these writes (and, replication being one ordered stream, everything before them); too few
        replicas raise :class:`ReplicasBehind` carrying the outcomes.
        """
        items = list(items)
        job_keys: dict[str, tuple[str, str, str]] = {}
        calls = [self._call(row, reply_to, job_keys) for row, reply_to in items]
        outcomes: list[PublishOutcome | None] = [None] * len(calls)
        if self.replica_acks and in_cluster(self.redis):
            # WAIT counts the replicas of one master, for one connection's writes: on a Cluster each
            # master's calls go down its own connection, followed by their WAIT
            groups: dict[int, tuple[redis.Redis, list[int]]] = {}
            for i, (keys, _) in enumerate(calls):
                client = master_client(self.redis, keys[0])
                groups.setdefault(id(client), (client, []))[1].append(i)
            try:
                replicas = min((self._run(client, todo, items, calls, outcomes)
                                for client, todo in groups.values()), default=self.replica_acks)
            except (redis.ResponseError, redis.ConnectionError) as e:
                failure = moved_or_down(self.redis, e)
                if failure is e:
                    raise
                raise failure from e
        else:
            replicas = self._run(self.redis, list(range(len(calls))), items, calls, outcomes)
        if replicas < self.replica_acks:
            raise ReplicasBehind(replicas, self.replica_acks, self.replica_timeout_ms,
                                 outcomes)  # type: ignore[arg-type]  # every slot is filled
        return outcomes  # type: ignore[return-value]  # every slot is filled once todo is empty

    def _run(self, client: redis.Redis, todo: list[int], items: list[tuple[Row, str | None]],
             calls: list[tuple[list[str], list]], outcomes: list[PublishOutcome | None]) -> int:
        """:meth:`publish_many`'s pipeline on ``client`` for the calls ``todo``, filling their
        ``outcomes``; returns the replicas its WAIT counted (``replica_acks`` when it sends none).

        The rows go as ``publish_rows.lua`` calls of up to ``PUBLISH_CHUNK`` rows that share a
        slot (one partition's: on a Cluster a call's keys must), in one pipeline."""
        replicas = self.replica_acks
        failed: str | None = None
        for _ in range(NOSCRIPT_RETRIES + 1):
            if not todo:
                break
            chunks = _chunks(todo, calls)
            times = self._times()
            pipe = client.pipeline(transaction=False)
            for chunk in chunks:
                keys, args = _packed(chunk, calls, times)
                pipe.evalsha(self._publish_rows.sha, len(keys), *keys, *args)
            if self.replica_acks:
                pipe.execute_command("WAIT", self.replica_acks, self.replica_timeout_ms)
            replies = pipe.execute(raise_on_error=False)
            if self.replica_acks:
                replicas = replies.pop()
                if isinstance(replicas, Exception):
                    raise replicas
            missing: list[int] = []
            for chunk, reply in zip(chunks, replies, strict=True):
                if isinstance(reply, NoScriptError):
                    missing += chunk  # the call never ran: its rows go again
                elif isinstance(reply, Exception):
                    raise reply
                else:
                    failed = self._outcomes(chunk, reply, items, outcomes) or failed
            if missing:
                client.script_load(self._publish_rows.script)
            todo = missing
        if todo:
            raise NoScriptError(f"publish script still missing after {NOSCRIPT_RETRIES} reloads")
        if failed is not None:
            raise RowsFailed(failed, outcomes)
        return int(replicas)

    def _outcomes(self, chunk: list[int], reply: list, items: list[tuple[Row, str | None]],
                  outcomes: list[PublishOutcome | None]) -> str | None:
        """Fill ``outcomes`` of the rows ``chunk`` from a ``publish_rows.lua`` reply; returns the
        error of the first row that failed (its outcome stays None), if one did."""
        codes, skipped, errors = as_text(reply[0]), reply[1], reply[2]
        streams: dict[int, list[str]] = {}
        for n in range(0, len(skipped), 2):
            streams.setdefault(int(skipped[n]) - 1, []).append(skipped[n + 1])
        for pos, (i, code) in enumerate(zip(chunk, codes, strict=True)):
            if code == "e":
                continue
            outcomes[i] = self._outcome(items[i][0], [int(code in "1f"), int(code == "f"),
                                                      streams.get(pos, ()), int(code == "d")])
        if not errors:
            return None
        row = items[chunk[int(errors[0]) - 1]][0]
        return (f"{len(errors) // 2} row(s) failed, the first of request {row.request_id}: "
                f"{as_text(errors[1])}")

    def wait_for_replicas(self, client: redis.Redis | None = None) -> None:
        """With ``replica_acks``: WAIT until that many replicas have the writes so far of ``client``
        (default this publisher's; on a Cluster, :func:`~batchinfer.redis_conn.master_client` of the
        keys written), a pooled connection used by one thread: its last write's; else
        :class:`ReplicasBehind`. For writes made outside :meth:`publish_many` (a worker's acks)."""
        if not self.replica_acks:
            return
        client = client if client is not None else self.redis
        acked = int(client.execute_command("WAIT", self.replica_acks, self.replica_timeout_ms))
        if acked < self.replica_acks:
            raise ReplicasBehind(acked, self.replica_acks, self.replica_timeout_ms)

    def finish_submission(self, job_id: str, total: int) -> bool:
        """Record that job ``job_id`` has ``total`` requests; ``validating`` -> ``in_progress``.

        Returns True when this call made the job final (every row was already published): the
        caller then enqueues the export. Raises KeyError for a job that does not exist.
        """
        if total < 0:
            raise ValueError(f"total must be >= 0, got {total}")
        result = self._finish(keys=[self.keys.job(job_id)], args=[total, self.clock()])
        if result == -1:
            raise KeyError(f"job {job_id!r} does not exist")
        return bool(result)

    def is_published(self, job_id: str | None, idx: int | None, request_id: str | None = None) -> bool:
        """Whether request ``idx`` of ``job_id`` (or the direct request ``request_id``) has its row."""
        return self.published_mask([(job_id, idx, request_id)])[0]

    def published_mask(self, requests: Iterable[tuple[str | None, int | None, str | None]]) -> list[bool]:
        """``is_published`` for many ``(job_id, idx, request_id)`` triples in one round trip: a job's
        requests read their guard bits with one GETRANGE of the bytes they span (a worker checks
        every batch it reads: one command per job, not per request; a GETBIT each where they span
        more than ``GUARD_SPAN_BYTES``), a direct request its guard."""
        requests = list(requests)
        by_job: dict[str, list[int]] = {}
        for job_id, idx, request_id in requests:
            if job_id:
                if idx is None or idx < 0:
                    raise ValueError(f"request of job {job_id!r} has no valid idx: {idx!r}")
                by_job.setdefault(job_id, []).append(idx)
            elif not request_id:
                raise ValueError("a direct request needs its request_id")
        if not requests:
            return []
        pipe = self.redis.pipeline(transaction=False)
        spans: dict[str, int] = {}  # job -> the first byte its GETRANGE read
        for job_id, idxs in by_job.items():
            first, last = min(idxs) // 8, max(idxs) // 8
            if last - first < GUARD_SPAN_BYTES:
                spans[job_id] = first
                pipe.getrange(self.keys.published(job_id), first, last)
        for job_id, idx, request_id in requests:
            if not job_id:
                pipe.exists(self.keys.published_direct(request_id))  # type: ignore[arg-type]  # checked
            elif job_id not in spans:
                pipe.getbit(self.keys.published(job_id), idx)  # type: ignore[arg-type]  # checked
        replies = iter(pipe.execute())
        bits = {job_id: next(replies) for job_id in spans}
        mask = []
        for job_id, idx, _ in requests:
            if not job_id or job_id not in spans:
                mask.append(bool(next(replies)))
                continue
            data, at = bits[job_id], idx // 8 - spans[job_id]  # type: ignore[operator]  # checked
            mask.append(at < len(data) and bool(data[at] >> (7 - idx % 8) & 1))  # type: ignore[operator]
        return mask


class Redelivery:
    """Idempotency of intake entries by ``client_request_id``, and the rows their retries are owed.

    A retry (same ``client_request_id``, within the claim's TTL) is dropped as a duplicate, but its
    ``reply_to`` still gets the first request's row: at once when that row is published, else when
    it is (``publish.lua``), and never twice on one stream nor anywhere else.
    """

    def __init__(self, redis_client: redis.Redis, keys: Keys, reply_ttl: int = DIRECT_GUARD_TTL):
        self.keys, self.reply_ttl = keys, int(reply_ttl)
        self._claim = scripts.register(redis_client, "claim_request")
        self._redeliver = scripts.register(redis_client, "redeliver")

    def claim(self, client_request_id: str, request_id: str, reply_to: str | None, ttl: int,
              job_id: str | None = None) -> str:
        """Claim ``client_request_id`` for ``request_id`` (of ``job_id``; None: a direct request) for
        ``ttl`` seconds; returns the request id that holds it: ``request_id`` itself for the first
        entry (or a re-read of it), else the first request's (this entry is a duplicate). With
        partitions, a claim is seen by the entries whose rows share its partition: direct requests
        all together, a job's with those of the other jobs of its partition (docs/protocol.md)."""
        keys = [self.keys.idempotency(client_request_id, job_id), self.keys.redelivery(request_id, job_id)]
        first = self._claim(keys=keys, args=[request_id, int(ttl), reply_to or ""])
        return as_text(first)

    def redeliver(self, first_request_id: str, reply_to: str, job_id: str | None = None) -> str:
        """Owe ``reply_to`` the row of ``first_request_id``: ``delivered`` (it was published: XADDed
        now), ``waiting`` (XADDed when published), ``same`` / ``already`` (that stream gets or got it
        anyway), ``wrongtype`` (the key is not a stream) or ``unknown`` (nothing kept for it).
        ``job_id``: the duplicate's job (its claim's partition is the first request's)."""
        keys = [self.keys.redelivery(first_request_id, job_id), reply_to]
        return as_text(self._redeliver(keys=keys, args=[self.reply_ttl]))


def _packed(chunk: list[int], calls: list[tuple[list[str], list]],
            times: list[int]) -> tuple[list[str], list]:
    """KEYS and ARGV of one ``publish_rows.lua`` call for the rows ``chunk``: each distinct key once
    (a job's guard, results stream and job hash serve all of its rows), and per row its spec (idx,
    counter, the KEYS positions of its keys) and its JSON: two values a row for redis-py to encode
    where there were eight."""
    where: dict[str, int] = {}
    keys: list[str] = []
    args: list = [*times]
    for i in chunk:
        row_keys, (idx, text, counter) = calls[i]
        refs = []
        for key in row_keys:
            n = where.get(key)
            if n is None:
                keys.append(key)
                n = where[key] = len(keys)
            refs.append(n)
        args.append(f"{idx} {counter} {' '.join(map(str, refs))}")
        args.append(text)
    return keys, args


def _chunks(todo: list[int], calls: list[tuple[list[str], list]]) -> list[list[int]]:
    """The rows ``todo`` in groups of up to ``PUBLISH_CHUNK`` whose keys share a hash tag (a row's
    keys all carry its partition's: docs/protocol.md), in the order their tags first appear."""
    groups: dict[str, list[list[int]]] = {}
    for i in todo:
        guard = calls[i][0][0]
        tag = guard[guard.find("{"):guard.find("}") + 1]
        chunks = groups.setdefault(tag, [[]])
        if len(chunks[-1]) == PUBLISH_CHUNK:
            chunks.append([])
        chunks[-1].append(i)
    return [chunk for chunks in groups.values() for chunk in chunks]
