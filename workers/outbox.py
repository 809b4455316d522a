"""What a worker owes Redis: rows to publish, requests to retry, batches to acknowledge, exports.

The worker's loop queues everything here and :meth:`Outbox.flush` sends it, in order, once per
iteration. Nothing leaves the outbox before Redis has confirmed it, so a Redis outage only delays
it (every step is idempotent: the publish guard drops a row sent twice, XACK / XDEL of a gone entry
is a no-op, a retried request carries its attempt count).

- **Rows** go out in one pipeline per chunk (:meth:`batchinfer.store.publish.Publisher.publish_many`).
  A row may carry a dead letter: it is XADDed to ``{p}:deadletter`` only by the call that
  actually published the row, so a re-sent row never dead-letters twice.
- **Retries**: a request the engine failed on goes back to its batch stream (the model's, or its
  adapter's when ``lora`` is set) as a batch of its own with ``attempts + 1`` (any worker may take
  it) instead of getting its error row, until ``max_attempts``; ``{p}:attempts:<job>`` mirrors the
  count (docs/worker.md, "Faults").
- **Acknowledgements**: a batch entry is XACKed and XDELed on its own stream (one MULTI for all)
  once every request of it has its row or its retry; entries are the worker's keys
  (:mod:`batchinfer.workers.streams`).
- **Exports**: the job this worker's row made final gets its rq export enqueued.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import redis

from batchinfer.keys import DIRECT, WORKERS_GROUP, Keys
from batchinfer.protocol.batches import retry_batches
from batchinfer.protocol.rows import BatchRequest, ResultRow
from batchinfer.store import replies
from batchinfer.store.publish import Publisher
from batchinfer.workers.inflight import Book
from batchinfer.workers.streams import BatchStreams

log = logging.getLogger(__name__)

FLUSH_CHUNK = 256  # rows per publish pipeline


@dataclass
class DeadLetter:
    """A request given up on after ``attempts`` failed tries: its ``{p}:deadletter`` entry."""

    request: BatchRequest
    error: str
    attempts: int
    entries: set[str]  # the batch entries it came in
    worker: str

    def fields(self) -> dict[str, str]:
        """The entry's fields (those of the scheduler's dead letters, plus the worker)."""
        return {"request": json.dumps(self.request.to_dict()), "error": self.error,
                "batch": ",".join(sorted(self.entries)), "model": self.request.model or "",
                "worker": self.worker}


@dataclass
class Outgoing:
    """A row to publish, and the dead letter to record if this row is what gives its request up."""

    row: ResultRow
    reply_to: str | None = None
    dead_letter: DeadLetter | None = None


def attempts_field(request: BatchRequest) -> tuple[str, str]:
    """``({p}:attempts:<job> key suffix, field)`` of a request: its idx, or a direct request's id."""
    if request.job_id:
        return request.job_id, str(request.idx)
    return DIRECT, request.request_id


class Outbox:
    """Rows, retries, acknowledgements and exports owed to Redis by one worker."""

    def __init__(self, r: redis.Redis, keys: Keys, streams: BatchStreams, publisher: Publisher, *,
                 enqueue_export: Callable[[str], None], on_published: Callable[[ResultRow], None],
                 on_acked: Callable[[list[str]], None], max_attempts: int, chunk: int = FLUSH_CHUNK):
        self.redis, self.keys, self.streams, self.publisher = r, keys, streams, publisher
        self.max_attempts = max_attempts
        self.enqueue_export, self.on_published, self.on_acked = enqueue_export, on_published, on_acked
        self.chunk = chunk
        self.rows: deque[Outgoing] = deque()
        self.retries: deque[BatchRequest] = deque()  # already carrying their new attempt count
        self.acks: list[str] = []  # keys of batch entries to XACK + XDEL
        self.exports: list[str] = []  # jobs made final by this worker: export to enqueue
        self.dead_letters: list[DeadLetter] = []  # of rows this worker published: to record

    def add(self, row: ResultRow, reply_to: str | None = None, dead_letter: DeadLetter | None = None) -> None:
        self.rows.append(Outgoing(row, reply_to, dead_letter))

    def retry(self, request: BatchRequest) -> None:
        """Send ``request`` back to its batch stream for another try (``attempts`` + 1)."""
        self.retries.append(dataclasses.replace(request, attempts=request.attempts + 1))

    def ack(self, entries: list[str]) -> None:
        self.acks += entries

    def empty(self) -> bool:
        return not (self.rows or self.retries or self.acks or self.exports or self.dead_letters)

    def flush(self, book: Book) -> int:
        """Send everything owed; returns the number of rows sent (published or found already there).

        Raises on a Redis error with everything not yet confirmed still queued.
        """
        if self.retries:
            self._send_retries(book)
        sent = 0
        while self.rows:
            chunk = list(itertools.islice(self.rows, self.chunk))
            outcomes = self.publisher.publish_many([(o.row, o.reply_to) for o in chunk])
            for o, outcome in zip(chunk, outcomes, strict=True):
                self.rows.popleft()
                if outcome.published:
                    self.on_published(o.row)
                    if o.dead_letter is not None:  # only the publication that won records it
                        self.dead_letters.append(o.dead_letter)
                if outcome.finalizing and o.row.job_id:
                    self.exports.append(o.row.job_id)
                self.acks += book.done(o.row.request_id)
            sent += len(chunk)
        if self.dead_letters:
            pipe = self.redis.pipeline(transaction=True)
            for dead in self.dead_letters:
                pipe.xadd(self.keys.deadletter, replies.xadd_fields(dead.fields()))
                job, field = attempts_field(dead.request)
                pipe.hset(self.keys.attempts(job), field, dead.attempts)
            pipe.execute()
            self.dead_letters = []
        if self.acks:
            pipe = self.redis.pipeline(transaction=True)
            for stream, ids in self.streams.by_stream(self.acks).items():
                pipe.xack(stream, WORKERS_GROUP, *ids)
                pipe.xdel(stream, *ids)  # acked batches are history: keep Redis memory flat
            pipe.execute()
            self.on_acked(self.acks)
            self.acks = []
        while self.exports:
            self.enqueue_export(self.exports[0])
            self.exports.pop(0)
        return sent

    def _send_retries(self, book: Book) -> None:
        """One MULTI: new batch entries holding every request to retry (those on their last attempt
        alone, in ``solo`` batches: ``retry_batches``) on its own stream, and their attempt counts."""
        requests = list(self.retries)
        by_adapter: dict[str | None, list[BatchRequest]] = {}
        for q in requests:
            by_adapter.setdefault(q.lora, []).append(q)
        pipe = self.redis.pipeline(transaction=True)
        for adapter, group in by_adapter.items():
            for fields in retry_batches(group, self.max_attempts):
                pipe.xadd(self.streams.stream(adapter), replies.xadd_fields(fields))
        for q in requests:
            job, field = attempts_field(q)
            pipe.hset(self.keys.attempts(job), field, q.attempts)
        pipe.execute()
        log.warning("re-dispatched %d request(s) the engine failed on: %s", len(requests),
                    ", ".join(f"{q.request_id} (attempt {q.attempts + 1})" for q in requests))
        self.retries.clear()
        for q in requests:
            self.acks += book.done(q.request_id)
