"""Job records (``{bi}:job:<job>`` hashes, docs/protocol.md) and the ``{bi}:jobs`` index.

This module owns the record's format: its field names (:class:`JobField`), its statuses
(:class:`JobStatus`) and how raw hash values parse (:func:`parse_status`, :func:`parse_fields`).
Other modules name fields and statuses through these, never as string literals; the Lua scripts
in ``lua/`` are the one other place that spells them.

The store only reads and writes records; who moves a job between states is the scheduler's and
the publisher's business. Status changes that must not race (cancel, conditional transitions)
are one Lua call each.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from enum import Enum
from typing import TYPE_CHECKING, Any

import redis

from batchinfer.keys import Keys
from batchinfer.protocol.entries import valid_job_id
from batchinfer.protocol.rows import now_ms
from batchinfer.redis_conn import as_text
from batchinfer.store import replies, scripts

if TYPE_CHECKING:
    from redis.typing import EncodableT, FieldT


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

    @property
    def timestamp_field(self) -> JobField:
        """The field that holds when a job entered this status: ``<status>_at``; ``created_at``
        for ``validating``, the status a job is created in."""
        return JobField.CREATED_AT if self is JobStatus.VALIDATING else JobField(f"{self.value}_at")

    def __str__(self) -> str:
        return self.value


class JobField(str, Enum):
    """The fields of a ``{bi}:job:<job>`` hash (docs/protocol.md, "Job record").

    Members are ``str``, so they go to redis-py as the field names themselves.
    """

    ID = "id"
    STATUS = "status"
    MODEL = "model"
    INPUT_NAME = "input_name"
    OUTPUT = "output"
    OUTPUT_FORMAT = "output_format"
    # OpenAI's error file: the rows that did not complete (``output`` then gets the completed ones);
    # the destination asked for, then the file written (as ``output``)
    ERROR_OUTPUT = "error_output"
    TENANT = "tenant"  # whose job it is: a tenant's jobs share one fair-share group in the scheduler
    PRIORITY = "priority"
    COMPLETION_WINDOW = "completion_window"
    METADATA = "metadata"
    TOTAL = "total"  # set when the submission ends
    SUBMITTED = "submitted"
    # rows published, counted by row status (records written before cancelled and expired rows
    # were counted apart have them in `failed`, and no cancelled / expired field: read as 0)
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"
    EXPIRED = "expired"
    ERRORS = "errors"
    CREATED_AT = "created_at"
    IN_PROGRESS_AT = "in_progress_at"
    FINALIZING_AT = "finalizing_at"
    COMPLETED_AT = "completed_at"
    FAILED_AT = "failed_at"
    EXPIRES_AT = "expires_at"
    EXPIRED_AT = "expired_at"
    CANCELLING_AT = "cancelling_at"
    CANCELLED_AT = "cancelled_at"
    # export bookkeeping, written by the Lua scripts: every row is in (publish.lua / finalize.lua),
    # the file is written (mark_exported.lua), the last export attempt failed (mark_export_failed.lua)
    EXPORT_REQUESTED_AT = "export_requested_at"
    EXPORTED_AT = "exported_at"
    EXPORT_ERROR = "export_error"
    # intake, written by the scheduler: requests in the holding area now (model not served), and
    # lines whose own `model` differed from the job's (which wins): how many, and up to 8 names
    HELD = "held"
    MODELS_OVERRIDDEN = "models_overridden"
    OVERRIDDEN_MODELS = "overridden_models"
    # token sums over the job's rows, written by the export (mark_exported.lua): OpenAI's batch `usage`
    PROMPT_TOKENS = "prompt_tokens"
    COMPLETION_TOKENS = "completion_tokens"
    CACHED_TOKENS = "cached_tokens"
    # dataset jobs (op open): the submitter wrote a kept table of input columns (``1``), the output is
    # Hive-partitioned on these kept columns (comma-separated), the unit of work the job covers; and,
    # written by the export, the location of the unit's manifest below the output root
    KEPT = "kept"
    PARTITION_BY = "partition_by"
    UNIT = "unit"
    MANIFEST = "manifest"

    def __str__(self) -> str:
        return self.value


TERMINAL = frozenset({JobStatus.COMPLETED, JobStatus.FAILED, JobStatus.EXPIRED, JobStatus.CANCELLED})
TIMESTAMPS = tuple(f.value for f in JobField if f.value.endswith("_at") and not f.value.startswith("export"))
# a result row's status -> the job counter its publication bumps (publish.lua)
ROW_COUNTERS = {"completed": JobField.COMPLETED, "failed": JobField.FAILED, "cancelled": JobField.CANCELLED,
                "expired": JobField.EXPIRED}
_INT_FIELDS = frozenset({JobField.HELD, JobField.MODELS_OVERRIDDEN,
                         JobField.PRIORITY, JobField.COMPLETION_WINDOW, JobField.TOTAL, JobField.SUBMITTED,
                         JobField.COMPLETED, JobField.FAILED, JobField.CANCELLED, JobField.EXPIRED,
                         *map(JobField, TIMESTAMPS),
                         JobField.EXPORT_REQUESTED_AT, JobField.EXPORTED_AT,
                         JobField.PROMPT_TOKENS, JobField.COMPLETION_TOKENS, JobField.CACHED_TOKENS})
_JSON_FIELDS = frozenset({JobField.METADATA, JobField.ERRORS, JobField.OVERRIDDEN_MODELS})
_DATASET_FIELDS = frozenset({JobField.KEPT, JobField.PARTITION_BY})


def parse_status(raw: bytes | str | None) -> JobStatus | None:
    """The status a hash's raw ``status`` value names; None when absent or not a status.

    Lenient on purpose: a record some other producer wrote must not stop a daemon's loop.
    """
    if raw is None:
        return None
    try:
        return JobStatus(as_text(raw))
    except (ValueError, UnicodeDecodeError):
        return None


def parse_field(name: JobField, raw: bytes | str | None) -> Any:
    """One raw hash value in its type: status -> :class:`JobStatus` (see :func:`parse_status`),
    counters and times -> ``int``, ``metadata`` / ``errors`` -> JSON, ``kept`` -> ``bool``,
    ``partition_by`` -> ``list[str]`` (comma-separated), others -> ``str``.
    Absent or empty -> None. A counter or time that is not an integer is a ``ValueError``.
    """
    if raw is None:
        return None
    if name is JobField.STATUS:
        return parse_status(raw)
    text = as_text(raw)
    if text == "":
        return None
    if name in _INT_FIELDS:
        return int(text)
    if name in _JSON_FIELDS:
        return json.loads(text)
    if name is JobField.KEPT:
        return text.lower() in ("1", "true")
    if name is JobField.PARTITION_BY:
        return text.split(",")
    return text


def parse_fields(names: Sequence[JobField], values: Sequence[bytes | str | None]) -> dict[JobField, Any]:
    """``HMGET <job> *names``'s reply, parsed field by field (:func:`parse_field`)."""
    return {name: parse_field(name, raw) for name, raw in zip(names, values, strict=True)}


def read_status(redis_client: redis.Redis, keys: Keys, job_id: str) -> JobStatus | None:
    """Job ``job_id``'s status, None for no job (one HGET)."""
    return parse_status(redis_client.hget(keys.job(job_id), JobField.STATUS))


_last_id_ms = 0  # the ms of this process's last job id


def new_job_id() -> str:
    """A fresh job id, sortable by creation time: ``job_<ms hex>_<random hex>``. Within a process the
    ms part strictly increases (two jobs submitted in one millisecond still list in their order)."""
    global _last_id_ms
    _last_id_ms = max(now_ms(), _last_id_ms + 1)
    return f"job_{_last_id_ms:012x}_{secrets.token_hex(6)}"


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
    cancelled: int = 0  # rows of requests the job's cancellation ended
    expired: int = 0  # rows of requests its completion window ended
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
    exported_at: int | None = None  # the results file is written (``output`` names it)
    held: int = 0  # requests in the holding area now (their model is not served)
    models_overridden: int = 0  # lines whose own `model` was overridden by the job's
    overridden_models: list[str] = field(default_factory=list)  # up to 8 of those names
    error_output: str | None = None  # OpenAI's error file: asked for, then the file written
    tenant: str | None = None  # the fair-share group of the tenant's jobs (None: the job's own)
    # token sums over the rows, set by the export (None until then): OpenAI's batch `usage`
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    kept: bool = False  # a kept table of input columns is joined to the rows by idx at export
    partition_by: list[str] = field(default_factory=list)  # kept columns the output is partitioned on
    unit: str | None = None  # the unit of work (its manifest's name below the output root)
    manifest: str | None = None  # the unit's manifest, once exported (partitioned output)

    @property
    def request_counts(self) -> dict[str, int]:
        """``total`` (submitted so far while validating), the rows in by status (``completed``,
        ``failed``, ``cancelled``, ``expired``) and ``held`` (waiting for their model now)."""
        total = self.total if self.total is not None else self.submitted
        return {"total": total, "completed": self.completed, "failed": self.failed,
                "cancelled": self.cancelled, "expired": self.expired, "held": self.held}

    @property
    def usage(self) -> dict[str, Any] | None:
        """OpenAI's batch ``usage`` (``input_tokens``, ``input_tokens_details.cached_tokens``,
        ``output_tokens``, ``output_tokens_details.reasoning_tokens``, ``total_tokens``) from the
        sums the export recorded; None until the job is exported."""
        if self.prompt_tokens is None:
            return None
        prompt, completion = self.prompt_tokens, self.completion_tokens or 0
        return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": self.cached_tokens or 0},
                "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": prompt + completion}

    @property
    def done(self) -> int:
        """Requests that have their row, whatever its status."""
        return self.completed + self.failed + self.cancelled + self.expired

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
        """The record an HGETALL returned; an unknown status is a ``ValueError``."""
        d = {as_text(k): as_text(v) for k, v in raw.items()}
        known = {f.name for f in fields(cls)}
        values: dict[str, Any] = {}
        for k, v in d.items():
            if k not in known or v == "" or k == JobField.STATUS:
                continue
            values[k] = parse_field(JobField(k), v)
        values["status"] = JobStatus(d.get(JobField.STATUS) or JobStatus.VALIDATING)
        return cls(**values)


def _window(seconds: int) -> str:
    """A completion window as OpenAI spells it (``"24h"``), in seconds when not whole hours."""
    return f"{seconds // 3600}h" if seconds % 3600 == 0 else f"{seconds}s"


def openai_batch(record: JobRecord) -> dict[str, Any]:
    """The job as an OpenAI Batch object (``batchinfer status JOB --json --format openai``).

    Statuses already have OpenAI's names; times are unix **seconds** (ours are ms); a job's
    ``errors`` become ``{"object": "list", "data": [{"code", "message", "param", "line"}]}``.
    ``request_counts`` has OpenAI's three keys, so ``failed`` there counts failed, cancelled and
    expired requests together (``completed + failed == total`` once the job ended; our own
    record keeps them apart). ``output_file_id`` is the results file once written (it may be a
    path or a URI). ``error_file_id`` is the job's ``error_output`` once written, else null: without
    one the job's file holds its error rows too (an OpenAI line with ``error`` set), and naming it
    twice would have an OpenAI client read every row twice; ``batchinfer results JOB -o OUT
    --error-file ERR`` writes OpenAI's two files. ``usage`` is :attr:`JobRecord.usage` (null until
    exported). ``endpoint`` is null: a job may mix ``/v1/chat/completions`` and ``/v1/completions``
    lines (each row keeps its line's ``url``).
    """
    counts = record.request_counts
    unsuccessful = record.failed + record.cancelled + record.expired
    output = record.output if record.exported_at is not None else None
    error_output = record.error_output if record.exported_at is not None else None

    def seconds(ms: int | None) -> int | None:
        return None if ms is None else ms // 1000

    errors = ({"object": "list", "data": [{"code": "job_error", "message": e, "param": None, "line": None}
                                          for e in record.errors]} if record.errors else None)
    return {
        "id": record.id, "object": "batch", "endpoint": None, "errors": errors,
        "input_file_id": record.input_name, "completion_window": _window(record.completion_window),
        "status": record.status.value, "output_file_id": output,
        "error_file_id": error_output,
        **{name: seconds(getattr(record, name)) for name in (
            "created_at", "in_progress_at", "expires_at", "finalizing_at", "completed_at", "failed_at",
            "expired_at", "cancelling_at", "cancelled_at")},
        "request_counts": {"total": counts["total"], "completed": record.completed, "failed": unsuccessful},
        "metadata": dict(record.metadata) or None,
        "usage": record.usage,
    }


def delete_kept(files_root: str, job_id: str) -> bool:
    """Delete job ``job_id``'s kept table under ``files_root`` (the file store root); whether one was
    there."""
    # here, not at the top: pyarrow is no import of the daemons that only read and write records
    from batchinfer.datasets.kept import kept_location
    from batchinfer.datasets.uris import filesystem_for

    fs, path = filesystem_for(kept_location(files_root, job_id))
    try:
        fs.delete_file(path)
    except FileNotFoundError:
        return False
    return True


def _encode(value: Any, name: str = "") -> str:
    if isinstance(value, Enum):
        return str(value.value)
    if isinstance(value, bool):
        return "1" if value else "0"
    if name == JobField.PARTITION_BY:
        return ",".join(value)
    if isinstance(value, (dict, list)):
        return json.dumps(value, ensure_ascii=False)
    return str(value)


class JobStore:
    """Reads and writes job records under one key prefix."""

    def __init__(self, redis_client: redis.Redis, keys: Keys):
        self.redis = redis_client
        self.keys = keys
        self._transition = scripts.register(redis_client, "set_status")
        self._cancel = scripts.register(redis_client, "cancel_job")

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
        if not self.redis.hsetnx(key, JobField.ID, job_id):
            raise ValueError(f"job {job_id} already exists")
        mapping: dict[FieldT, EncodableT] = {
            f.name: _encode(getattr(record, f.name), f.name) for f in fields(record)
            if getattr(record, f.name) is not None and f.name != JobField.TOTAL
            and not (f.name in _DATASET_FIELDS and not getattr(record, f.name))}  # a plain job has none
        pipe = self.redis.pipeline(transaction=True)
        pipe.hset(key, mapping=mapping)
        pipe.zadd(self.keys.for_job(job_id).jobs, {job_id: created})
        pipe.execute()
        return record

    def get(self, job_id: str) -> JobRecord | None:
        raw = self.redis.hgetall(self.keys.job(job_id))
        return JobRecord.from_hash(raw) if raw else None

    def get_many(self, job_ids: Iterable[str]) -> list[JobRecord | None]:
        """The records of ``job_ids`` in one round trip, None where a job has none."""
        pipe = self.redis.pipeline(transaction=False)
        for job_id in job_ids:
            pipe.hgetall(self.keys.job(job_id))
        return [JobRecord.from_hash(raw) if raw else None for raw in pipe.execute()]

    def list(self, limit: int = 100, offset: int = 0) -> list[JobRecord]:
        """The newest ``limit`` jobs first (of every partition)."""
        ids = newest_jobs(self.redis, self.keys, offset + limit)[offset:]
        return [r for r in self.get_many(ids) if r is not None]

    def delete(self, job_id: str, *, files_root: str | None = None) -> None:
        """Delete the job: its record, results, bookkeeping and index entries (one MULTI). For an
        ended job only: a live one's daemons would go on writing its keys.

        ``files_root`` (``Settings.files_root()``): a dataset job's kept table there goes first (a
        missing one is no error), so that no table outlives its record unnoticed."""
        if files_root is not None:
            delete_kept(files_root, job_id)
        keys = self.keys.for_job(job_id)  # every name below is in the job's partition
        pipe = self.redis.pipeline(transaction=True)
        pipe.delete(keys.job(job_id), keys.results(job_id), keys.published(job_id), keys.attempts(job_id),
                    keys.admitted(job_id))
        pipe.zrem(keys.jobs, job_id)
        pipe.srem(keys.cancelled, job_id)
        pipe.execute()

    def update(self, job_id: str, **values: Any) -> None:
        """Set plain fields (not the status); ``None`` values are removed."""
        key = self.keys.job(job_id)
        present: dict[FieldT, EncodableT] = {k: _encode(v) for k, v in values.items() if v is not None}
        absent = [k for k, v in values.items() if v is None]
        pipe = self.redis.pipeline(transaction=True)
        if present:
            pipe.hset(key, mapping=present)
        if absent:
            pipe.hdel(key, *absent)
        pipe.execute()

    def set_manifest(self, job_id: str, location: str | None) -> None:
        """Record where the export wrote the manifest of the job's unit (None: remove it); the
        record's ``output`` (the dataset root) is written with the export's status change."""
        self.update(job_id, **{JobField.MANIFEST.value: location})

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

    def incr(self, job_id: str, field_name: JobField | str, amount: int = 1) -> int:
        return int(self.redis.hincrby(self.keys.job(job_id), JobField(field_name), amount))

    def cancel(self, job_id: str) -> JobStatus | None:
        """Ask for cancellation: a live job goes ``cancelling`` and joins its partition's ``{p}:cancelled``.

        Returns the job's status after the call (unchanged when it had already ended, or is
        ``finalizing``: every request has its row, so nothing is left to cancel), ``None``
        for an unknown job. The scheduler turns pending requests into ``cancelled`` rows within a
        second, worker or not (staged and held ones, and batches no live worker holds:
        ``batchinfer.scheduler.accounting.Settler``), workers abort the ones they hold, and the job
        ends ``cancelled``.
        """
        result = self._cancel(keys=[self.keys.job(job_id), self.keys.for_job(job_id).cancelled],
                              args=[job_id, now_ms()])
        if result is None:
            return None
        return JobStatus(as_text(result))

    def is_cancelled(self, job_id: str) -> bool:
        """Whether cancellation was asked for (``cancelling`` or ``cancelled``)."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.sismember(self.keys.for_job(job_id).cancelled, job_id)
        pipe.hget(self.keys.job(job_id), JobField.STATUS)
        member, status = pipe.execute()
        return bool(member) or parse_status(status) in (JobStatus.CANCELLING, JobStatus.CANCELLED)

    def cancelled_jobs(self) -> set[str]:
        """Ids in every partition's ``{p}:cancelled`` (what workers poll every few steps)."""
        return cancelled_jobs(self.redis, self.keys)


def newest_jobs(r: redis.Redis, keys: Keys, count: int) -> list[str]:
    """The ids of the ``count`` newest jobs of every partition, newest first (each partition's index
    is read for its own newest ``count``, one round trip, then merged by creation time)."""
    if count <= 0:
        return []
    if keys.partitions == 1:
        return [as_text(j, "replace") for j in replies.members(r.zrevrange(keys.jobs, 0, count - 1))]
    pipe = r.pipeline(transaction=False)
    for part in keys.parts():
        pipe.zrevrange(part.jobs, 0, count - 1, withscores=True)
    scored = [(score, as_text(job, "replace"))
              for reply in pipe.execute() for job, score in replies.scored(reply)]
    scored.sort(reverse=True)  # as one ZREVRANGE orders them: by score, then member, descending
    return [job for _, job in scored[:count]]


def cancelled_jobs(r: redis.Redis, keys: Keys) -> set[str]:
    """The ids in every partition's cancelled set (one round trip)."""
    pipe = r.pipeline(transaction=False)
    for part in keys.parts():
        pipe.smembers(part.cancelled)
    return {as_text(m) for reply in pipe.execute() for m in replies.members(reply)}
