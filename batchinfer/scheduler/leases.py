"""Leases: take back batches whose worker stopped refreshing them, and re-dispatch the rest.

A worker keeps a batch by re-claiming its pending entry every ``lease_seconds / 3``. An entry idle
longer than ``lease_seconds`` is XAUTOCLAIMed here. Of its requests, those already published are
dropped (the exactly-once guard says so), those of cancelled / expired jobs get their row, and
each other one counts an attempt (workers count one too for each engine failure, see
``batchinfer.workers.service.outbox``): at ``max_attempts`` it is dead-lettered (``{p}:deadletter`` +
a ``dead_lettered`` row), otherwise it goes into a new batch (one of its own, run alone, on its
last attempt: :func:`batchinfer.protocol.batches.retry_batches`). The new batch, the attempt counts,
the dead letters and the XACK + XDEL of the old entry are one MULTI. The attempt count travels
in the batch entry (``attempts``), so a crash between claim and MULTI never counts twice;
``{p}:attempts:<job>`` mirrors it for operators.
"""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING

import redis

from batchinfer.config import Settings
from batchinfer.keys import DIRECT, WORKERS_GROUP, Keys
from batchinfer.protocol.batches import SOLO_FIELD, retry_batches
from batchinfer.protocol.rows import BatchRequest, ResultRow
from batchinfer.redis_conn import as_text
from batchinfer.scheduler.lookups import JobCache, RowSink
from batchinfer.store import replies
from batchinfer.store.ownership import Ownership
from batchinfer.store.registry import Registry

if TYPE_CHECKING:
    from redis.typing import EncodableT, FieldT

log = logging.getLogger(__name__)

CLAIM_COUNT = 16  # batch entries claimed per XAUTOCLAIM call
MAX_CLAIMS_PER_PASS = 64  # XAUTOCLAIM calls per model per pass


class Leases:
    """Reclaims expired batch leases for every registered model."""

    def __init__(self, r: redis.Redis, keys: Keys, settings: Settings, registry: Registry, jobs: JobCache,
                 sink: RowSink, consumer: str, fence: Ownership):
        self.redis, self.keys, self.registry, self.jobs, self.sink = r, keys, registry, jobs, sink
        self.fence = fence  # a batch is taken back only while this scheduler is the owner
        self.lease_ms = max(1, int(settings.lease_seconds * 1000))
        self.max_attempts = settings.max_attempts
        self.consumer = consumer

    def step(self) -> int:
        """Reclaim every expired lease now; returns the number of batches taken back."""
        return sum(self.reclaim(model) for model in self.registry.models())

    def reclaim(self, model: str) -> int:
        stream, start, taken = self.keys.batches(model), "0-0", 0
        for _ in range(MAX_CLAIMS_PER_PASS):
            try:
                reply = self.redis.xautoclaim(stream, WORKERS_GROUP, self.consumer, self.lease_ms,
                                              start_id=start, count=CLAIM_COUNT)
            except redis.ResponseError as e:
                if "NOGROUP" in str(e):
                    return taken  # no batch stream yet
                raise
            start, claimed = reply[0], reply[1]
            for entry_id, fields in claimed:
                self._take_back(model, as_text(entry_id), fields)
                taken += 1
            if start in (b"0-0", "0-0"):
                break
        return taken

    def _take_back(self, model: str, entry_id: str, fields: dict[bytes, bytes] | None) -> None:
        stream = self.keys.batches(model)
        pipe = self.fence.transaction()
        requests = self._parse(entry_id, fields, pipe) if fields else []
        published = self.sink.publisher.published_mask([(q.job_id, q.idx, q.request_id) for q in requests])
        pending = [q for q, done in zip(requests, published, strict=True) if not done]
        views = self.jobs.get_many([q.job_id for q in pending if q.job_id])
        again, dead = [], 0
        tries: dict[str, dict[FieldT, EncodableT]] = {}  # attempts key -> field -> count (bookkeeping, below)
        for q in pending:
            ended = views[q.job_id].ended_as() if q.job_id else None
            if ended:
                self.sink.publish(ResultRow.error(ended, f"the job was {ended} before this request ran",
                                                  status=ended, request=q), q.reply_to)
                continue
            q.attempts += 1
            tries.setdefault(self.keys.attempts(q.job_id or DIRECT), {})[
                str(q.idx if q.job_id else q.request_id)] = q.attempts
            if q.attempts < self.max_attempts:
                again.append(q)
                continue
            message = (f"the request was tried {q.attempts} times: its worker stopped refreshing the lease "
                       f"({self.lease_ms / 1000:g} s) or its engine failed on it; giving up")
            self.sink.publish(ResultRow.error("dead_lettered", message, request=q), q.reply_to)
            pipe.xadd(self.keys.deadletter, {"request": json.dumps(q.to_dict()), "error": message,
                                             "batch": entry_id, "model": model})
            dead += 1
        retries = retry_batches(again, self.max_attempts)
        for retry in retries:
            pipe.xadd(stream, replies.xadd_fields(retry))
        pipe.xack(stream, WORKERS_GROUP, entry_id)
        pipe.xdel(stream, entry_id)
        pipe.execute()
        self._record_attempts(tries)
        metrics = self.sink.metrics
        if metrics is not None:
            metrics.lease_reclaimed(model, len(pending))
            if dead:
                metrics.request_dead_lettered(model, dead)
        solo = sum(SOLO_FIELD in fields for fields in retries)
        log.warning("model %s: lease of batch %s expired: %d published, %d re-dispatched (%d to run alone), "
                    "%d dead-lettered", model, entry_id, len(requests) - len(pending), len(again), solo, dead)

    def _record_attempts(self, tries: dict[str, dict[FieldT, EncodableT]]) -> None:
        """Write the attempt counts, a record for people (each retry carries its own count): after the
        fenced MULTI, as a direct request's counts live in partition 0, another Cluster slot."""
        if tries:
            pipe = self.redis.pipeline(transaction=False)
            for key, counts in tries.items():
                pipe.hset(key, mapping=counts)
            pipe.execute()

    def _parse(self, entry_id: str, fields: dict[bytes, bytes], pipe: redis.client.Pipeline) -> list:
        """The batch's requests; an unreadable batch goes to the dead-letter stream whole."""
        try:
            items = json.loads(fields[b"requests"])
            return [BatchRequest.from_dict(item) for item in items]
        except (KeyError, ValueError, TypeError, AttributeError) as e:
            log.error("batch %s is unreadable, dead-lettered: %s", entry_id, e)
            pipe.xadd(self.keys.deadletter, replies.xadd_fields(
                {**fields, b"error": f"unreadable batch entry: {e}".encode(), b"batch": entry_id.encode()}))
            return []
