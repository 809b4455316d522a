"""Job records (``{bi}:job:<job>`` hashes, docs/protocol.md) and the ``{bi}:jobs`` index.

The store only reads and writes records; who moves a job between states is the scheduler's and
the publisher's business. Status changes that must not race (cancel, conditional transitions)
are one Lua call each.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields
from enum import Enum
from typing import Any

import redis

from batchinfer.keys import Keys
from batchinfer.protocol.entries import valid_job_id
from batchinfer.protocol.rows import now_ms


class JobStatus(str, Enum):
    """A job's lifecycle, as in the OpenAI Batch API."""

    VALIDATING = "validating"
    IN_PROGRESS = "in_progress"
    FINALIZING = "finalizing"
    COMPLETED = "completed"
    FAILED = "failed"
    EXPIRED = "expired"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"

    @property
    def terminal(self) -> bool:
        return self in TERMINAL

    def __str__(self) -> str:
        return self.value


TERMINAL = frozenset({JobStatus.COMPLETED, JobStatus.FAILED, JobStatus.EXPIRED, JobStatus.CANCELLED})
TIMESTAMPS = ("created_at", "in_progress_at", "finalizing_at", "completed_at", "failed_at", "expires_at",
              "expired_at", "cancelling_at", "cancelled_at")
_INT_FIELDS = ("priority", "completion_window", "total", "submitted", "completed", "failed", *TIMESTAMPS)
_JSON_FIELDS = ("metadata", "errors")

# KEYS[1] job hash. ARGV: new status, its timestamp field, now ms, then allowed current statuses.
# Sets status (+ timestamp) only when the job exists and its status is one of the allowed ones.
_TRANSITION = """
local cur = redis.call('HGET', KEYS[1], 'status')
if not cur then return false end
local ok = (#ARGV == 3)
for i = 4, #ARGV do if ARGV[i] == cur then ok = true end end
if not ok then return cur end
redis.call('HSET', KEYS[1], 'status', ARGV[1], ARGV[2], ARGV[3])
return 'OK'
"""

# KEYS[1] job hash, KEYS[2] cancelled set. ARGV: job id, now ms.
_CANCEL = """
local cur = redis.call('HGET', KEYS[1], 'status')
if not cur then return false end
if cur == 'completed' or cur == 'failed' or cur == 'expired' or cur == 'cancelled' or cur == 'cancelling'
then return cur end
redis.call('HSET', KEYS[1], 'status', 'cancelling', 'cancelling_at', ARGV[2])
redis.call('SADD', KEYS[2], ARGV[1])
return 'cancelling'
"""


def new_job_id() -> str:
    """A fresh job id, sortable by creation time: ``job_<ms hex>_<random hex>``."""
    return f"job_{now_ms():012x}_{secrets.token_hex(6)}"


@dataclass
class JobRecord:
    """A job's record; times are ms since the epoch (UTC), ``None`` when not reached."""

    id: str
    status: JobStatus
    model: str | None = None
    input_name: str | None = None
    output: str | None = None  # requested destination; the written file once completed
    output_format: str = "parquet"
    priority: int = 0
    completion_window: int = 24 * 3600  # seconds
    metadata: dict[str, str] = field(default_factory=dict)
    total: int | None = None  # set when submission ends
    submitted: int = 0
    completed: int = 0
    failed: int = 0
    errors: list[str] = field(default_factory=list)
    created_at: int | None = None
    in_progress_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expires_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None

    @property
    def request_counts(self) -> dict[str, int]:
        """``total`` (submitted so far while validating), ``completed``, ``failed``."""
        total = self.total if self.total is not None else self.submitted
        return {"total": total, "completed": self.completed, "failed": self.failed}

    @property
    def done(self) -> int:
        return self.completed + self.failed

    @property
    def terminal(self) -> bool:
        return self.status.terminal

    def to_dict(self) -> dict[str, Any]:
        """The JSON shape of ``batchinfer status --json``."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["status"] = self.status.value
        out["request_counts"] = self.request_counts
        return out

    @classmethod
    def from_hash(cls, raw: Mapping[bytes | str, bytes | str]) -> JobRecord:
        d = {(k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v)
             for k, v in raw.items()}
        known = {f.name for f in fields(cls)}
        values: dict[str, Any] = {}
        for k, v in d.items():
            if k not in known or v == "":
                continue
            if k in _INT_FIELDS:
                values[k] = int(v)
            elif k in _JSON_FIELDS:
                values[k] = json.loads(v)
            else:
                values[k] = v
        values["status"] = JobStatus(values.get("status", "validating"))
        return cls(**values)


def _encode(value: Any) -> str:
    if isinstance(value, Enum):
        return str(value.value)
    if isinstance(value, (dict, list)):
        return json.dumps(value, ensure_ascii=False)
    return str(value)


class JobStore:
    """Reads and writes job records under one key prefix."""

    def __init__(self, redis_client: redis.Redis, keys: Keys):
        self.redis = redis_client
        self.keys = keys
        self._transition = redis_client.register_script(_TRANSITION)
        self._cancel = redis_client.register_script(_CANCEL)

    def create(self, job_id: str | None = None, *, model: str | None = None, input_name: str | None = None,
               output: str | None = None, output_format: str = "parquet", priority: int = 0,
               completion_window: int = 24 * 3600, metadata: Mapping[str, str] | None = None) -> JobRecord:
        """Create a ``validating`` job; an existing id is a ``ValueError`` (ids are never reused)."""
        job_id = job_id or new_job_id()
        if not valid_job_id(job_id):
            raise ValueError(f"job id {job_id!r} is invalid (letters, digits, '.', '_', '-'; at most 128)")
        if completion_window <= 0:
            raise ValueError(f"completion_window must be > 0 seconds, got {completion_window}")
        created = now_ms()
        record = JobRecord(id=job_id, status=JobStatus.VALIDATING, model=model, input_name=input_name,
                           output=output, output_format=output_format, priority=priority,
                           completion_window=completion_window, metadata=dict(metadata or {}),
                           created_at=created, expires_at=created + completion_window * 1000)
        key = self.keys.job(job_id)
        if not self.redis.hsetnx(key, "id", job_id):
            raise ValueError(f"job {job_id} already exists")
        mapping = {f.name: _encode(getattr(record, f.name)) for f in fields(record)
                   if getattr(record, f.name) is not None and f.name != "total"}
        pipe = self.redis.pipeline(transaction=True)
        pipe.hset(key, mapping=mapping)
        pipe.zadd(self.keys.jobs, {job_id: created})
        pipe.execute()
        return record

    def get(self, job_id: str) -> JobRecord | None:
        raw = self.redis.hgetall(self.keys.job(job_id))
        return JobRecord.from_hash(raw) if raw else None

    def list(self, limit: int = 100, offset: int = 0) -> list[JobRecord]:
        """The newest ``limit`` jobs first."""
        ids = self.redis.zrevrange(self.keys.jobs, offset, offset + limit - 1)
        pipe = self.redis.pipeline(transaction=False)
        for job_id in ids:
            pipe.hgetall(self.keys.job(job_id.decode() if isinstance(job_id, bytes) else job_id))
        return [JobRecord.from_hash(raw) for raw in pipe.execute() if raw]

    def update(self, job_id: str, **values: Any) -> None:
        """Set plain fields (not the status); ``None`` values are removed."""
        key = self.keys.job(job_id)
        present = {k: _encode(v) for k, v in values.items() if v is not None}
        absent = [k for k, v in values.items() if v is None]
        pipe = self.redis.pipeline(transaction=True)
        if present:
            pipe.hset(key, mapping=present)
        if absent:
            pipe.hdel(key, *absent)
        pipe.execute()

    def set_status(self, job_id: str, status: JobStatus | str, *,
                   expect: Iterable[JobStatus | str] | None = None, **values: Any) -> bool:
        """Move a job to ``status`` and stamp ``<status>_at``, plus optional plain fields.

        With ``expect``, only a job currently in one of those statuses moves (atomically); returns
        whether the status was set. A missing job is never created.
        """
        status = JobStatus(status)
        allowed = [JobStatus(s).value for s in expect] if expect is not None else []
        if expect is not None and not allowed:
            return False
        result = self._transition(keys=[self.keys.job(job_id)],
                                  args=[status.value, f"{status.value}_at", now_ms(), *allowed])
        moved = result in (b"OK", "OK")
        if moved and values:
            self.update(job_id, **values)
        return moved

    def incr(self, job_id: str, field_name: str, amount: int = 1) -> int:
        return int(self.redis.hincrby(self.keys.job(job_id), field_name, amount))

    def cancel(self, job_id: str) -> JobStatus | None:
        """Ask for cancellation: a live job goes ``cancelling`` and joins ``{bi}:cancelled``.

        Returns the job's status after the call (unchanged when it had already ended), ``None``
        for an unknown job. The scheduler turns pending requests into ``cancelled`` rows, workers
        abort running ones, and the job ends ``cancelled``.
        """
        result = self._cancel(keys=[self.keys.job(job_id), self.keys.cancelled], args=[job_id, now_ms()])
        if result is None:
            return None
        return JobStatus(result.decode() if isinstance(result, bytes) else result)

    def is_cancelled(self, job_id: str) -> bool:
        """Whether cancellation was asked for (``cancelling`` or ``cancelled``)."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.sismember(self.keys.cancelled, job_id)
        pipe.hget(self.keys.job(job_id), "status")
        member, status = pipe.execute()
        return bool(member) or status in (b"cancelling", b"cancelled", "cancelling", "cancelled")

    def cancelled_jobs(self) -> set[str]:
        """Ids in ``{bi}:cancelled`` (what workers poll every few steps)."""
        return {m.decode() if isinstance(m, bytes) else m for m in self.redis.smembers(self.keys.cancelled)}
