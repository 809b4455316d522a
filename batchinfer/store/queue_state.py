"""Read-only views of the queue's state in Redis, for metrics collectors, ``batchinfer top`` and doctor.

Every function reads a bounded amount (a few commands per stream, jobs in chunks up to a cap), so a
Prometheus scrape or a ``top`` refresh stays cheap however many requests are queued. Formats are
those of docs/protocol.md; key names come from :class:`batchinfer.keys.Keys`.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import redis

from batchinfer.keys import SCHEDULER_GROUP, WORKERS_GROUP, Keys
from batchinfer.protocol.rows import now_ms
from batchinfer.redis_conn import as_text
from batchinfer.store import replies
from batchinfer.store.jobstore import JobField, JobStatus, newest_jobs, parse_status

ACTIVE_JOB_STATUSES = frozenset(s for s in JobStatus if not s.terminal)
JOB_STATUSES = tuple(s.value for s in JobStatus)
LAG_COUNT_CAP = 1000  # when Redis cannot tell a group's lag, count at most this many entries
# Replies are read with as_text(..., "replace"): a view must not fail on one stray byte.


def _int(value: Any, default: int = 0) -> int:
    try:
        return int(as_text(value, "replace"))
    except (TypeError, ValueError):
        return default


@dataclass(frozen=True)
class StreamState:
    """One stream and one of its consumer groups.

    ``undelivered``: entries not yet read by the group (a lower bound of ``LAG_COUNT_CAP`` when
    Redis < 7 or a deleted entry hides the exact lag); ``unacked``: read but not acknowledged;
    ``oldest_undelivered_ms``: the id time of the first undelivered entry (None when none).
    """

    length: int = 0
    undelivered: int = 0
    unacked: int = 0
    oldest_undelivered_ms: int | None = None
    group_exists: bool = False

    def lag_seconds(self, now: int | None = None) -> float:
        """Age of the oldest entry the group has not read yet (0 when it has read everything)."""
        if self.oldest_undelivered_ms is None:
            return 0.0
        return max(0.0, ((now if now is not None else now_ms()) - self.oldest_undelivered_ms) / 1000)


def _id_ms(entry_id: Any) -> int:
    return _int(as_text(entry_id, "replace").split("-", 1)[0])


def stream_state(r: redis.Redis, stream: str, group: str) -> StreamState:
    """Length, lag and pending count of ``group`` on ``stream`` (zeros when the stream is absent)."""
    length = r.xlen(stream)
    if length == 0 and not r.exists(stream):
        return StreamState()
    try:
        groups = r.xinfo_groups(stream)
    except redis.ResponseError:
        groups = []
    info = next(({as_text(k, "replace"): v for k, v in g.items()} for g in groups
                 if as_text(g.get("name"), "replace") == group), None)
    if info is None:  # nobody consumes yet: every entry waits
        first = r.xrange(stream, count=1)
        return StreamState(length=length, undelivered=length,
                           oldest_undelivered_ms=_id_ms(first[0][0]) if first else None)
    last = as_text(info.get("last-delivered-id", "0-0"), "replace")
    following = r.xrange(stream, min=f"({last}", max="+", count=1)
    lag = info.get("lag")
    if lag is None:  # Redis < 7, or tombstones in the stream: count, up to a cap
        lag = 0
        if following:
            lag = len(replies.entries(r.xrange(stream, min=f"({last}", max="+", count=LAG_COUNT_CAP)))
    return StreamState(length=length, undelivered=_int(lag), unacked=_int(info.get("pending")),
                       oldest_undelivered_ms=_id_ms(following[0][0]) if following else None,
                       group_exists=True)


def combined(states: list[StreamState]) -> StreamState:
    """One stream's state across its partitions (counts added, the oldest undelivered entry's time)."""
    if len(states) == 1:
        return states[0]
    oldest = [s.oldest_undelivered_ms for s in states if s.oldest_undelivered_ms is not None]
    return StreamState(length=sum(s.length for s in states), undelivered=sum(s.undelivered for s in states),
                       unacked=sum(s.unacked for s in states),
                       oldest_undelivered_ms=min(oldest, default=None),
                       group_exists=any(s.group_exists for s in states))


def partitioned_state(r: redis.Redis, keys: Keys, stream_of: Callable[[Keys], str],
                      group: str) -> StreamState:
    """``stream_state`` of the stream ``stream_of(view)`` names in each partition, combined."""
    return combined([stream_state(r, stream_of(view), group) for view in keys.parts()])


def known_models(r: redis.Redis, keys: Keys) -> list[str]:
    """Registered model names (``{p}:models``), sorted."""
    return sorted(as_text(m, "replace") for m in r.smembers(keys.models))


def held_models(r: redis.Redis, keys: Keys) -> dict[str, int]:
    """Requests held now for a model no worker serves (``{p}:held_models``), by model; counts > 0 only."""
    pipe = r.pipeline(transaction=False)
    for part in keys.parts():  # each partition counts its own holding area
        pipe.hgetall(part.held_models)
    counts: Counter[str] = Counter()
    for reply in pipe.execute():
        for m, n in replies.hash_fields(reply).items():
            counts[as_text(m, "replace")] += _int(n)
    return {m: n for m, n in sorted(counts.items()) if n > 0}


def held_models_of(r: redis.Redis, keys: Keys, job_id: str, cap: int = LAG_COUNT_CAP) -> list[str]:
    """The models one job's held requests wait for (``held_model`` of its ``{p}:held`` entries), in
    the order held: ``status`` names them for a job without a model. Reads at most ``cap`` entries
    of the holding area, oldest first."""
    job, models = job_id.encode(), dict[str, None]()  # in the order held
    held = keys.for_job(job_id).held  # the job's partition holds its entries
    for _, fields in replies.entries(r.xrange(held, count=cap)):
        if fields.get(b"job") == job and b"held_model" in fields:
            models[as_text(fields[b"held_model"], "replace")] = None
    return list(models)


def served_models(r: redis.Redis, keys: Keys) -> list[str]:
    """The names live workers answer to now: their models, their adapters' models (``BASE:NAME``)
    and the aliases of both (``{p}:model_aliases``: ``--served-model-name``, adapter short
    names), sorted."""
    from batchinfer.store.registry import Registry

    live: set[str] = set()
    for w in Registry(r, keys).live_workers():
        adapters = w.info.get("adapter_models")
        live |= {w.model, *(adapters if isinstance(adapters, list) else [])}
    aliases = {as_text(a, "replace"): as_text(m, "replace") for a, m in r.hgetall(keys.model_aliases).items()}
    return sorted(live | {a for a, m in aliases.items() if m in live})


@dataclass(frozen=True)
class QueueState:
    """Intake (scheduler group), batches per model (workers group) and the dead-letter stream; the
    streams' states span every partition."""

    intake: StreamState
    batches: dict[str, StreamState]
    deadletter: int


def queue_state(r: redis.Redis, keys: Keys) -> QueueState:
    """Depths of every queue batchinfer keeps in Redis."""
    return QueueState(
        intake=partitioned_state(r, keys, lambda view: view.requests, SCHEDULER_GROUP),
        batches={m: partitioned_state(r, keys, functools.partial(Keys.batches, model=m), WORKERS_GROUP)
                 for m in known_models(r, keys)},
        deadletter=_sum(r, [("xlen", part.deadletter) for part in keys.parts()]),
    )


def _sum(r: redis.Redis, calls: list[tuple[str, str]]) -> int:
    """The sum of one integer command per key (``(command, key)``), in one round trip."""
    pipe = r.pipeline(transaction=False)
    for command, key in calls:
        getattr(pipe, command)(key)
    return sum(int(n) for n in pipe.execute())


class JobStatusCounter:
    """Counts the ``max_jobs`` most recent jobs by status, scrape after scrape.

    A job in a terminal status never leaves it, so its status is remembered and only the other
    jobs are read again: a scrape with 10,000 finished jobs costs one ZREVRANGE.
    """

    def __init__(self, max_jobs: int = 10_000, chunk: int = 500):
        self.max_jobs, self.chunk = max_jobs, chunk
        self._terminal: dict[str, str] = {}

    def count(self, r: redis.Redis, keys: Keys) -> dict[str, int]:
        """Every status listed, 0s kept."""
        counts = dict.fromkeys(JOB_STATUSES, 0)
        ids = newest_jobs(r, keys, self.max_jobs)
        unknown = [j for j in ids if j not in self._terminal]
        for start in range(0, len(unknown), self.chunk):
            part = unknown[start:start + self.chunk]
            pipe = r.pipeline(transaction=False)
            for job_id in part:
                pipe.hget(keys.job(job_id), JobField.STATUS)
            for job_id, status in zip(part, pipe.execute(), strict=True):
                if status is None:  # removed since the ZREVRANGE
                    continue
                name = as_text(status, "replace")
                counts[name] = counts.get(name, 0) + 1
                parsed = parse_status(status)
                if parsed is not None and parsed.terminal:
                    self._terminal[job_id] = name
        known, fresh = set(ids), set(unknown)
        for job_id in ids:
            if job_id not in fresh and job_id in self._terminal:
                counts[self._terminal[job_id]] += 1
        if len(self._terminal) > len(known):  # forget jobs that left the window (or were deleted)
            self._terminal = {j: s for j, s in self._terminal.items() if j in known}
        return counts


def jobs_by_status(r: redis.Redis, keys: Keys, max_jobs: int = 10_000) -> dict[str, int]:
    """How many of the ``max_jobs`` most recent jobs are in each status (every status listed)."""
    return JobStatusCounter(max_jobs).count(r, keys)


@dataclass(frozen=True)
class JobView:
    """What ``top`` shows of one job; ``total`` is None while its submission is still running.

    ``held``: requests waiting for a model no worker serves; ``cancelled`` / ``expired``: rows the
    job's cancellation or window wrote (counted in ``done``, not in the rate: they are not answers).
    """

    id: str
    status: str
    model: str
    submitted: int
    total: int | None
    completed: int
    failed: int
    created_at: int
    in_progress_at: int | None = None
    cancelled: int = 0
    expired: int = 0
    held: int = 0

    @property
    def done(self) -> int:
        return self.completed + self.failed + self.cancelled + self.expired

    @property
    def answered(self) -> int:
        """Rows the workers and the scheduler wrote (completed or failed): what the rate counts."""
        return self.completed + self.failed

    @property
    def known_total(self) -> int:
        return self.total if self.total is not None else self.submitted

    def rate(self, now: int) -> float | None:
        """Requests answered per second since the job started running (None before any was).

        Cancelled and expired rows arrive all at once and answer nothing: counting them would show
        a spike of requests/s right after a cancel.
        """
        start = self.in_progress_at or self.created_at
        elapsed = (now - start) / 1000
        if self.answered <= 0 or elapsed <= 0:
            return None
        return self.answered / elapsed

    def eta_seconds(self, now: int, served: bool = True) -> float | None:
        """Seconds left at the average rate so far; None when there is no bounded estimate: the total
        is unknown (still submitting), requests are held for a model no worker serves, no live
        worker serves the job's model (``served`` False: nothing runs what is left), the job is not
        running (cancelling, finalizing), or no request was answered yet."""
        rate = self.rate(now)
        if (rate is None or not served or self.total is None or self.held > 0
                or self.status != JobStatus.IN_PROGRESS.value):
            return None
        return max(0, self.total - self.done) / rate


def job_view(job_id: str, raw: dict[Any, Any]) -> JobView:
    """A :class:`JobView` from a ``{p}:job:<id>`` hash as HGETALL returns it."""
    h = {as_text(k, "replace"): as_text(v, "replace") for k, v in raw.items()}
    f = JobField
    return JobView(
        id=h.get(f.ID, job_id), status=h.get(f.STATUS, "?"), model=h.get(f.MODEL, ""),
        submitted=_int(h.get(f.SUBMITTED)),
        total=_int(h[f.TOTAL]) if h.get(f.TOTAL, "") != "" else None,
        completed=_int(h.get(f.COMPLETED)), failed=_int(h.get(f.FAILED)),
        created_at=_int(h.get(f.CREATED_AT)),
        in_progress_at=_int(h[f.IN_PROGRESS_AT]) if h.get(f.IN_PROGRESS_AT) else None,
        cancelled=_int(h.get(f.CANCELLED)), expired=_int(h.get(f.EXPIRED)), held=max(0, _int(h.get(f.HELD))),
    )


def active_jobs(r: redis.Redis, keys: Keys, scan: int = 500, limit: int = 50) -> list[JobView]:
    """Up to ``limit`` unfinished jobs among the ``scan`` most recent, oldest first."""
    ids = newest_jobs(r, keys, scan)
    pipe = r.pipeline(transaction=False)
    for job_id in ids:
        pipe.hgetall(keys.job(job_id))
    views = [job_view(j, raw) for j, raw in zip(ids, pipe.execute(), strict=True) if raw]
    active = [v for v in views if v.status in ACTIVE_JOB_STATUSES]
    return sorted(active, key=lambda v: v.created_at)[:limit]


@dataclass
class WorkerView:
    """A live worker as ``top`` shows it: fields of its heartbeat hash (see WorkerMetrics)."""

    name: str
    model: str
    heartbeat_at: int
    device: str = ""
    running: int | None = None
    waiting: int | None = None
    max_num_seqs: int | None = None
    kv_usage: float | None = None
    tokens_per_s: float | None = None
    spec_acceptance: float | None = None  # draft tokens accepted / verified (None: never drafted)
    spec_accepted_len: float | None = None  # tokens a drafting sequence gains per step, on average
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def load(self) -> float | None:
        """Running sequences over the engine's max: how full the worker's batch is."""
        if self.running is None or not self.max_num_seqs:
            return None
        return self.running / self.max_num_seqs


def _num(value: Any, cast=float) -> Any:
    try:
        return cast(value) if value is not None and value != "" else None
    except (TypeError, ValueError):
        return None


_WORKER_FIELDS = ("model", "device", "running", "waiting", "kv_usage", "tokens_per_s", "heartbeat_at",
                  "capacity", "spec_acceptance", "spec_accepted_len")


def live_workers(r: redis.Redis, keys: Keys) -> list[WorkerView]:
    """Workers with an unexpired registration, by name (via :class:`batchinfer.store.registry.Registry`)."""
    from batchinfer.store.registry import Registry

    views = []
    for w in Registry(r, keys).live_workers():
        info = w.info
        capacity = w.capacity
        views.append(WorkerView(
            name=w.name, model=w.model, heartbeat_at=w.heartbeat_at, device=str(info.get("device", "")),
            running=_num(info.get("running"), int), waiting=_num(info.get("waiting"), int),
            max_num_seqs=_num(capacity.get("max_num_seqs"), int),
            kv_usage=_num(info.get("kv_usage")), tokens_per_s=_num(info.get("tokens_per_s")),
            spec_acceptance=_num(info.get("spec_acceptance")),
            spec_accepted_len=_num(info.get("spec_accepted_len")),
            extra={k: v for k, v in info.items() if k not in _WORKER_FIELDS},
        ))
    return views
