"""The HTTP API's batches (OpenAI Batches, Anthropic Message Batches): their own attributes in Redis.

An API batch's id is also its job's id. Before that job exists (while the input file is validated)
the batch record ``{p}:apibatch:<id>`` is all there is; once submitted, the job record holds the
lifecycle and counts, and this record only what the vendor's object adds: endpoint, files, completion
window, metadata, validation errors. ``{p}:apibatches:<kind>:<owner>`` lists one key's batches of one
kind, scored by creation time (ms).
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any

import redis

from batchinfer.clock import WALL_MS, WallClock
from batchinfer.keys import Keys
from batchinfer.redis_conn import as_text
from batchinfer.store import scripts
from batchinfer.store.jobstore import JobStatus, JobStore

if TYPE_CHECKING:
    from redis.typing import EncodableT, FieldT

MAX_ID_CHARS = 64  # ids come from URL paths: longer ones are no batch's
QUEUE_PAGE = 1000  # batches read at once when counting a key's queued requests


class BatchKind(str, Enum):
    """Which vendor's API a batch was created through."""

    OPENAI = "openai"
    ANTHROPIC = "anthropic"


class BatchState(str, Enum):
    """Where an API batch stands before and at its job's creation (the job record says the rest)."""

    VALIDATING = JobStatus.VALIDATING.value  # no job yet: the input is being checked (as a new job is)
    SUBMITTED = "submitted"  # the job exists
    FAILED = "failed"  # validation failed: no job
    CANCELLED = "cancelled"  # cancelled before its job existed


@dataclass
class ApiBatch:
    """An API batch's own attributes. Times are ms since the epoch."""

    id: str
    kind: BatchKind
    owner: str  # the API key id
    endpoint: str
    input_file_id: str | None
    output_file_id: str | None
    error_file_id: str | None
    completion_window: str  # as given, e.g. "24h"
    metadata: dict[str, str]
    created_at: int
    state: BatchState = BatchState.VALIDATING
    errors: list[dict] = field(default_factory=list)  # validation errors: code, message, line, param
    ended_at: int | None = None  # failed, or cancelled before a job existed
    total: int | None = None  # requests in the batch, once counted


_OPTIONAL = ("input_file_id", "output_file_id", "error_file_id", "ended_at", "total")


def _record(b: ApiBatch) -> dict[FieldT, EncodableT]:
    out: dict[FieldT, EncodableT] = {
        "id": b.id, "kind": b.kind.value, "owner": b.owner, "endpoint": b.endpoint,
        "completion_window": b.completion_window, "metadata": json.dumps(b.metadata),
        "created_at": b.created_at, "state": b.state.value, "errors": json.dumps(b.errors)}
    for name in _OPTIONAL:
        value = getattr(b, name)
        out[name] = "" if value is None else value
    return out


def _parse(raw: dict) -> ApiBatch | None:
    if not raw:
        return None
    h = {as_text(k): as_text(v) for k, v in raw.items()}
    return ApiBatch(
        id=h["id"], kind=BatchKind(h["kind"]), owner=h["owner"], endpoint=h["endpoint"],
        input_file_id=h.get("input_file_id") or None, output_file_id=h.get("output_file_id") or None,
        error_file_id=h.get("error_file_id") or None, completion_window=h["completion_window"],
        metadata=json.loads(h.get("metadata") or "{}"), created_at=int(h["created_at"]),
        state=BatchState(h["state"]), errors=json.loads(h.get("errors") or "[]"),
        ended_at=int(h["ended_at"]) if h.get("ended_at") else None,
        total=int(h["total"]) if h.get("total") else None)


class ApiBatches:
    """API batch records and their per-key listings."""

    def __init__(self, redis_client: redis.Redis, keys: Keys, *, clock: WallClock = WALL_MS):
        self.redis = redis_client
        self.keys = keys
        self._clock = clock
        self._page = scripts.register(redis_client, "zset_page")
        self._set_state = scripts.register(redis_client, "api_batch_state")

    @staticmethod
    def new_id(kind: BatchKind) -> str:
        """A fresh batch id (also its job's id): ``batch_`` + 32 hex, or ``msgbatch_`` + 24 hex."""
        if BatchKind(kind) is BatchKind.OPENAI:
            return "batch_" + secrets.token_hex(16)
        return "msgbatch_" + secrets.token_hex(12)

    def create(self, batch: ApiBatch) -> None:
        """Write the batch's record and list it under its owner, in one transaction."""
        pipe = self.redis.pipeline(transaction=True)
        pipe.hset(self.keys.api_batch(batch.id), mapping=_record(batch))
        index = self.keys.api_batches(BatchKind(batch.kind).value, batch.owner)
        pipe.zadd(index, {batch.id: batch.created_at})
        pipe.execute()

    def read(self, batch_id: str) -> ApiBatch | None:
        """The batch whoever owns it, for the API's own jobs (a key's requests use :meth:`get`)."""
        if not isinstance(batch_id, str) or not batch_id or len(batch_id) > MAX_ID_CHARS:
            return None
        return _parse(self.redis.hgetall(self.keys.api_batch(batch_id)))

    def get(self, batch_id: str, owner: str) -> ApiBatch | None:
        """The batch, if ``owner``'s; None when there is none or it is another key's."""
        batch = self.read(batch_id)
        return batch if batch is not None and batch.owner == owner else None

    def list(self, kind: BatchKind, owner: str, *, limit: int = 20, after: str | None = None,
             before: str | None = None) -> tuple[list[ApiBatch], bool]:
        """A page of ``owner``'s batches of ``kind``, newest first; ``(batches, has_more)``.

        ``after=id``: the batches created before that one (OpenAI's ``after``, Anthropic's
        ``after_id``); ``before=id``: the ``limit`` batches created just after it (Anthropic's
        ``before_id``), still newest first, ``has_more`` saying whether newer ones remain. A cursor
        that is not one of ``owner``'s batches gives an empty page.
        """
        if not isinstance(limit, int) or limit < 1:
            raise ValueError(f"limit must be a positive integer, got {limit!r}")
        if after is not None and before is not None:
            raise ValueError("give after or before, not both")
        key = self.keys.api_batches(BatchKind(kind).value, owner)
        cursor_id = after if after is not None else before
        cursor: list[str] = []
        if cursor_id is not None:
            score = self.redis.zscore(key, cursor_id)
            if score is None:
                return [], False
            cursor = [repr(int(score)), cursor_id]
        flat = self._page(keys=[key], args=["asc" if before is not None else "desc", limit + 1, *cursor])
        ids = [as_text(m) for m in flat[0::2]]
        has_more = len(ids) > limit
        ids = ids[:limit]
        if before is not None:
            ids.reverse()  # the ones nearest the cursor, shown newest first
        pipe = self.redis.pipeline(transaction=False)
        for batch_id in ids:
            pipe.hgetall(self.keys.api_batch(batch_id))
        found = [_parse(raw) for raw in pipe.execute()]
        return [b for b in found if b is not None and b.owner == owner], has_more

    def set_state(self, batch_id: str, state: BatchState, *, expect: BatchState = BatchState.VALIDATING,
                  errors: Sequence[dict] | None = None, total: int | None = None) -> bool:
        """Move the batch from ``expect`` to ``state`` atomically (a cancel racing a validation: one
        wins); False, nothing written, when it is not in ``expect`` (or does not exist).

        ``errors`` and ``total`` are written with it; ``ended_at`` is set on ``failed`` and ``cancelled``.
        """
        extra: tuple[Any, ...] = ()
        if errors is not None:
            extra += ("errors", json.dumps(list(errors)))
        if total is not None:
            extra += ("total", int(total))
        if BatchState(state) in (BatchState.FAILED, BatchState.CANCELLED):
            extra += ("ended_at", self._clock())
        done = self._set_state(keys=[self.keys.api_batch(batch_id)],
                               args=[BatchState(expect).value, BatchState(state).value, *extra])
        return bool(done)

    def queued_requests(self, owner: str, *, exclude: str | None = None) -> int:
        """Requests still without a row in ``owner``'s batches (both kinds) whose jobs have not ended,
        but ``exclude``'s: what a key's queued-requests limit counts. Pages of :data:`QUEUE_PAGE`
        batches, their job records read in one round trip per page."""
        jobs, queued = JobStore(self.redis, self.keys), 0
        for kind in BatchKind:
            after: str | None = None
            while True:
                page, more = self.list(kind, owner, limit=QUEUE_PAGE, after=after)
                counted = [b for b in page if b.id != exclude]
                for batch, record in zip(counted, jobs.get_many(b.id for b in counted), strict=True):
                    if record is not None and not record.terminal:  # (none: no job yet, or none left)
                        queued += max((record.total or batch.total or record.submitted) - record.done, 0)
                if not more or not page:
                    break
                after = page[-1].id
        return queued

    def delete(self, batch_id: str) -> None:
        """Remove the batch's record and its listing entry (its job and files are others' to remove)."""
        batch = self.read(batch_id)
        if batch is None:
            return
        pipe = self.redis.pipeline(transaction=True)
        pipe.delete(self.keys.api_batch(batch_id))
        pipe.zrem(self.keys.api_batches(batch.kind.value, batch.owner), batch_id)
        pipe.execute()
