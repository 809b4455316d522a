"""What the scheduler looks up over and over, cached briefly: job states, model tokenizers.

Also :class:`RowSink`, the one way the scheduler publishes rows (error, cancelled, expired,
dead-lettered): publish exactly once, count it, and enqueue the export when the row was the
job's last.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import redis

from batchinfer.clock import WALL_MS, WallClock
from batchinfer.config import Settings
from batchinfer.jobs.queueing import enqueue_export, finish_then_export, publish_then_export
from batchinfer.keys import Keys
from batchinfer.protocol.entries import RequestError
from batchinfer.protocol.rows import ResultRow, now_ms
from batchinfer.store.jobstore import JobField, JobStatus, parse_fields
from batchinfer.store.publish import Publisher
from batchinfer.store.registry import ModelInfo, Registry, fingerprint
from batchinfer.workers.text.tokenizer import Tokenizer

if TYPE_CHECKING:  # the sink only calls the metrics it is handed
    from collections.abc import Sequence

    from batchinfer.ops.metrics import SchedulerMetrics

log = logging.getLogger(__name__)

CANCELLED_STATUSES = frozenset({JobStatus.CANCELLING, JobStatus.CANCELLED})
VIEW_FIELDS = (JobField.STATUS, JobField.MODEL, JobField.EXPIRES_AT, JobField.PRIORITY, JobField.TOTAL,
               JobField.TENANT)


@dataclass(frozen=True)
class JobView:
    """The few job fields the scheduler decides on; ``exists=False`` for an id with no record."""

    job_id: str
    exists: bool
    status: JobStatus | None = None  # None also for a status this version does not know
    model: str | None = None
    expires_at: int | None = None
    priority: int = 0
    total: int | None = None  # set once the job is closed (its submission ended)
    tenant: str | None = None  # its requests carry it: a tenant's jobs share one fair-share group

    def ended_as(self) -> str | None:
        """The row status, ``"cancelled"`` or ``"expired"``, of the job's pending requests when they
        must not run, else None.

        The job's status decides; the accounting sweep moves a job past its window to ``expired``.
        """
        if self.status in CANCELLED_STATUSES:
            return "cancelled"
        if self.status is JobStatus.EXPIRED:
            return "expired"
        return None


class JobCache:
    """Job views, each re-read after ``ttl`` seconds (so a cancel is seen within ``ttl``)."""

    def __init__(self, redis_client: redis.Redis, keys: Keys, ttl: float = 1.0, max_entries: int = 10_000):
        self.redis, self.keys, self.ttl, self.max_entries = redis_client, keys, ttl, max_entries
        self._views: dict[str, tuple[float, JobView]] = {}

    def get(self, job_id: str) -> JobView:
        return self.get_many([job_id])[job_id]

    def get_many(self, job_ids: list[str]) -> dict[str, JobView]:
        """Views of ``job_ids``; stale or missing ones are read in one round trip."""
        now = time.monotonic()
        out, stale = {}, []
        for job_id in dict.fromkeys(job_ids):
            hit = self._views.get(job_id)
            if hit and now - hit[0] < self.ttl:
                out[job_id] = hit[1]
            else:
                stale.append(job_id)
        if stale:
            pipe = self.redis.pipeline(transaction=False)
            for job_id in stale:
                pipe.hmget(self.keys.job(job_id), *VIEW_FIELDS)
            if len(self._views) + len(stale) > self.max_entries:
                self._views.clear()  # bounded memory; a miss costs one HMGET
            for job_id, values in zip(stale, pipe.execute(), strict=True):
                status, model, expires, priority, total, tenant = parse_fields(VIEW_FIELDS, values).values()
                view = JobView(job_id, exists=values[0] is not None, status=status, model=model,
                               expires_at=expires, priority=priority or 0, total=total, tenant=tenant)
                self._views[job_id] = (now, view)
                out[job_id] = view
        return out

    def forget(self, job_id: str) -> None:
        """Drop ``job_id``'s view: the next ``get`` reads it again (after a job op changed it)."""
        self._views.pop(job_id, None)


@dataclass(frozen=True)
class ServedModel:
    """A registered model and its tokenizer, built from the files its workers registered."""

    info: ModelInfo
    tokenizer: Tokenizer


def checked_token_ids(ids: list[int], tokenizer: Tokenizer, where: str) -> list[int]:
    """``ids`` (a producer's token ids, already checked to be non-negative ints) when every one is in
    ``tokenizer``'s vocabulary; else an ``invalid_request`` naming ``where[i]``."""
    vocab = tokenizer.vocab_size
    for i, t in enumerate(ids):
        if t >= vocab:
            raise RequestError("invalid_request", f"token id {t} is outside the model's vocabulary of "
                               f"{vocab} tokens", field=f"{where}[{i}]")
    return list(ids)


class ModelCache:
    """Tokenizers per model name, rebuilt when a model's tokenizer fingerprint changes.

    A name is a registered model or an alias of one (``--served-model-name``): an alias gives the
    model it routes to, so ``served.info.name`` is always the canonical name. An adapter model
    (``BASE:NAME``) registers its base's tokenizer files: models with the same files share one
    tokenizer, so dozens of adapters cost one.
    """

    def __init__(self, registry: Registry, refresh: float = 5.0):
        self.registry, self.refresh = registry, refresh
        self._models: dict[str, tuple[float, ServedModel | None]] = {}
        self._tokenizers: dict[str, Tokenizer] = {}  # by the sha256 of the tokenizer files alone
        self._adapters: dict[str, tuple[float, list[str]]] = {}  # base -> (read at, its adapter names)

    def get(self, name: str) -> ServedModel | None:
        """The served model ``name`` names, or None when no worker registered it or an alias of that
        name (re-checked each refresh)."""
        now = time.monotonic()
        hit = self._models.get(name)
        if hit and now - hit[0] < self.refresh:
            return hit[1]
        served = hit[1] if hit else None
        target, fingerprint = name, self.registry.model_fingerprint(name)
        if fingerprint is None and (canonical := self.registry.resolve_alias(name)) is not None:
            target, fingerprint = canonical, self.registry.model_fingerprint(canonical)
        if fingerprint is None:
            served = None
        elif served is None or served.info.name != target or served.info.fingerprint != fingerprint:
            served = self._load(target)
        if len(self._models) > 1024:  # unknown names must not grow memory without bound
            self._models.clear()
        self._models[name] = (now, served)
        return served

    def adapters(self, base: str) -> list[str]:
        """The adapter names registered for canonical model ``base`` (re-read each refresh: asked for
        every line of a job whose lines name another model)."""
        now = time.monotonic()
        hit = self._adapters.get(base)
        if hit and now - hit[0] < self.refresh:
            return hit[1]
        if len(self._adapters) > 1024:
            self._adapters.clear()
        names = self.registry.adapters_of(base)
        self._adapters[base] = (now, names)
        return names

    def _load(self, name: str) -> ServedModel | None:
        info = self.registry.get_model(name)
        if info is None:
            return None
        files = info.files
        digest = fingerprint(files)
        tokenizer = self._tokenizers.get(digest)
        if tokenizer is not None:
            return ServedModel(info, tokenizer)
        template = files.get("chat_template.jinja")
        try:
            tokenizer = Tokenizer.from_files(files["tokenizer.json"], files.get("tokenizer_config.json"),
                                             files.get("generation_config.json"),
                                             template.decode("utf-8") if template is not None else None)
        except ValueError as e:
            log.error("model %s: registered tokenizer files are unusable: %s", name, e)
            return None
        if len(self._tokenizers) >= 64:
            self._tokenizers.clear()  # bounded memory; a miss builds one tokenizer again
        self._tokenizers[digest] = tokenizer
        return ServedModel(info, tokenizer)


class RowSink:
    """Publishes the scheduler's rows exactly once and enqueues exports for jobs they complete."""

    def __init__(self, redis_client: redis.Redis, settings: Settings, keys: Keys,
                 metrics: SchedulerMetrics | None = None, clock: WallClock = WALL_MS):
        self.redis, self.settings, self.metrics = redis_client, settings, metrics
        self.publisher = Publisher(redis_client, keys, metrics=metrics, clock=clock,
                                   direct_retention_s=settings.direct_results_retention_seconds,
                                   replica_acks=settings.replica_acks,
                                   replica_timeout_ms=settings.replica_ack_timeout_ms)

    def publish(self, row: ResultRow, reply_to: str | None = None) -> bool:
        """Publish ``row``; returns whether this call wrote it."""
        if row.finished_at is None:
            row.finished_at = now_ms()
        [outcome] = publish_then_export(self.publisher, [(row, reply_to)], self.enqueue_export)
        if outcome.published and self.metrics is not None:
            self.metrics.row_published(row)
        return outcome.published

    def publish_many(self, rows: Sequence[tuple[ResultRow, str | None]]) -> None:
        """Publish ``(row, reply_to)`` pairs in one round trip (rows already stamped, not counted)."""
        publish_then_export(self.publisher, rows, self.enqueue_export)

    def finish_submission(self, job_id: str, total: int) -> None:
        """End job ``job_id``'s submission at ``total`` requests (``Publisher.finish_submission``)."""
        finish_then_export(self.publisher, job_id, total, self.enqueue_export)

    def enqueue_export(self, job_id: str) -> None:
        """Enqueue job ``job_id``'s export (rq's unique enqueue: at most one per job)."""
        enqueue_export(self.redis, self.settings, job_id)
        log.info("job %s: every request has its row; export enqueued", job_id)
