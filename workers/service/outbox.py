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
  (:mod:`batchinfer.workers.service.streams`).
- **Exports**: the job this worker's row made final gets its rq export enqueued.

:class:`PublisherThread` runs an outbox on a thread of its own, with a Redis connection of its own
(:func:`batchinfer.redis_conn.own_client`): the engine thread hands rows, retries and acks over
through a bounded queue (``put`` blocks when it is full: backpressure, nothing is dropped) and learns
back which requests are confirmed, so it never waits on Redis to publish. The order guarantees are the
outbox's: a batch entry is acked only after the engine thread saw all of its requests confirmed.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TypeVar

import redis

from batchinfer.jobs.queueing import publish_then_export
from batchinfer.keys import DIRECT, WORKERS_GROUP, Keys
from batchinfer.protocol.batches import retry_batches
from batchinfer.protocol.rows import BatchRequest, ResultRow
from batchinfer.redis_conn import Backoff, disconnect, master_client, moved_or_down
from batchinfer.store import replies
from batchinfer.store.publish import Publisher, ReplicasBehind, RowsFailed
from batchinfer.workers.service.inflight import Book
from batchinfer.workers.service.streams import BatchStreams

T = TypeVar("T")
log = logging.getLogger(__name__)

FLUSH_CHUNK = 256  # rows per publish pipeline
QUEUE_SIZE = 64  # hand-overs (one per loop iteration) the engine thread may be ahead of the publisher
# How long the publisher thread gathers hand-overs before a send of fewer than FLUSH_CHUNK rows, while
# the engine is busy: it hands rows over every step (1-30 ms), and a send per step paid a round trip,
# a wake-up and the GIL's hand-overs for a few rows each time (docs/benchmarks.md, "Coalesced sends").
LINGER_S = 0.01
BACKOFF_START_S, BACKOFF_CAP_S = 0.5, 10.0  # the publisher thread's waits after a failed send


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


def by_partition(items: Iterable[T], partition: Callable[[T], int]) -> dict[int, list[T]]:
    """``items`` grouped by ``partition(item)``, in order: what one MULTI may hold on Redis Cluster."""
    groups: dict[int, list[T]] = {}
    for item in items:
        groups.setdefault(partition(item), []).append(item)
    return groups


class Outbox:
    """Rows, retries, acknowledgements and exports owed to Redis by one worker."""

    def __init__(self, r: redis.Redis, keys: Keys, streams: BatchStreams, publisher: Publisher, *,
                 enqueue_export: Callable[[str], None], on_published: Callable[[list[ResultRow]], None],
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
        # (request id, a row: True / a retry: False) sent; confirmed once their dead letters are in
        self.sent: list[tuple[str, bool]] = []
        self.confirmed: list[tuple[str, bool]] = []  # the book not told yet (``settle``)
        # requests whose row this outbox published on an attempt that then lacked replica acks
        self.won: set[str] = set()

    def add(self, row: ResultRow, reply_to: str | None = None, dead_letter: DeadLetter | None = None) -> None:
        self.rows.append(Outgoing(row, reply_to, dead_letter))

    def retry(self, request: BatchRequest) -> None:
        """Send ``request`` back to its batch stream for another try (``attempts`` + 1)."""
        self.retries.append(dataclasses.replace(request, attempts=request.attempts + 1))

    def ack(self, entries: list[str]) -> None:
        self.acks += entries

    def empty(self) -> bool:
        return not (self.rows or self.retries or self.acks or self.exports or self.dead_letters
                    or self.sent or self.confirmed)

    def flush(self, book: Book, urgent: bool = False) -> int:  # noqa: ARG002 - it always sends at once
        """Send everything owed; returns the number of rows sent (published or found already there).

        Raises on a Redis error with everything not yet confirmed still queued.
        """
        self.send()
        rows = self.settle(book)
        self.send_acks()
        return rows

    def settle(self, book: Book) -> int:
        """Tell ``book`` which requests are confirmed: batches now complete are queued to ack.
        Returns the number of rows among them."""
        rows = 0
        for request_id, is_row in self.confirmed:
            self.acks += book.done(request_id)
            rows += is_row
        self.confirmed = []
        return rows

    def send(self) -> None:
        """Retries, rows, dead letters, exports; what Redis took moves to ``confirmed``.

        Raises on a Redis error with everything not yet confirmed still queued.
        """
        if self.retries:
            self._send_retries()
        while self.rows:
            chunk = list(itertools.islice(self.rows, self.chunk))
            # exports are enqueued below, after the dead letters, and kept across a Redis error
            try:
                outcomes = publish_then_export(self.publisher, [(o.row, o.reply_to) for o in chunk],
                                               self.exports.append)
            except (ReplicasBehind, RowsFailed) as partly:
                # on the master, not on enough replicas yet, or published beside rows Redis refused:
                # the rows stay to be sent again (their guard answers "already published" then), so
                # remember which publications were ours
                self.won.update(o.row.request_id for o, out in zip(chunk, partly.outcomes, strict=True)
                                if out is not None and out.published)
                raise
            published: list[ResultRow] = []
            for o, outcome in zip(chunk, outcomes, strict=True):
                self.rows.popleft()
                if outcome.published or o.row.request_id in self.won:
                    self.won.discard(o.row.request_id)
                    published.append(o.row)
                    if o.dead_letter is not None:  # only the publication that won records it
                        self.dead_letters.append(o.dead_letter)
                self.sent.append((o.row.request_id, True))
            if published:
                self.on_published(published)  # counted a chunk at a time (metrics' rows_published)
        if self.dead_letters:
            home = self.keys.job_partition  # a dead letter's partition: its request's job's
            for part, letters in by_partition(self.dead_letters, lambda d: home(d.request.job_id)).items():
                pipe = self.redis.pipeline(transaction=True)  # one MULTI per partition: one Cluster slot
                for dead in letters:
                    pipe.xadd(self.keys.part(part).deadletter, replies.xadd_fields(dead.fields()))
                    job, field = attempts_field(dead.request)
                    pipe.hset(self.keys.attempts(job), field, dead.attempts)
                pipe.execute()
                written = {id(dead) for dead in letters}  # a later partition's error keeps only its own
                self.dead_letters = [dead for dead in self.dead_letters if id(dead) not in written]
        self.confirmed += self.sent  # a batch is acked only after its dead letters are recorded
        self.sent = []
        while self.exports:
            self.enqueue_export(self.exports[0])
            self.exports.pop(0)

    def send_acks(self) -> None:
        """XACK + XDEL the complete batch entries (one MULTI); with replica acks, then WAIT for them
        (too few: :class:`ReplicasBehind`, the acks are sent again)."""
        if self.acks:
            by_stream = self.streams.by_stream(self.acks)
            waits: dict[int, redis.Redis] = {}  # the clients whose writes a WAIT must cover
            for streams in by_partition(by_stream, self.streams.partition_of).values():
                # with replica acks on a Cluster: the slot's master's own connection, for its WAIT
                client = master_client(self.redis, streams[0]) if self.publisher.replica_acks else self.redis
                pipe = client.pipeline(transaction=True)  # one MULTI per partition: one Cluster slot
                for stream in streams:
                    pipe.xack(stream, WORKERS_GROUP, *by_stream[stream])
                    pipe.xdel(stream, *by_stream[stream])  # acked batches are history: keep Redis memory flat
                try:
                    pipe.execute()
                except (redis.ResponseError, redis.ConnectionError) as e:
                    failure = moved_or_down(self.redis, e)
                    if failure is e:
                        raise
                    raise failure from e
                waits[id(client)] = client
            for client in waits.values():
                self.publisher.wait_for_replicas(client)
            self.on_acked(self.acks)
            self.acks = []

    def _send_retries(self) -> None:
        """One MULTI per partition (one Cluster slot): new batch entries holding every request to
        retry (those on their last attempt alone, in ``solo`` batches: ``retry_batches``) on its own
        stream, and their attempt counts. A partition's requests leave the queue once its MULTI ran,
        so an error in the next one never sends them twice."""
        by_stream: dict[str, list[BatchRequest]] = {}  # its adapter's, in its job's partition
        for q in self.retries:
            stream = self.streams.stream(q.lora, self.keys.job_partition(q.job_id))
            by_stream.setdefault(stream, []).append(q)
        for streams in by_partition(by_stream, self.streams.partition_of).values():
            pipe = self.redis.pipeline(transaction=True)
            requests = [q for stream in streams for q in by_stream[stream]]
            for stream in streams:
                for fields in retry_batches(by_stream[stream], self.max_attempts):
                    pipe.xadd(stream, replies.xadd_fields(fields))
            for q in requests:
                job, field = attempts_field(q)
                pipe.hset(self.keys.attempts(job), field, q.attempts)
            pipe.execute()
            log.warning("re-dispatched %d request(s) the engine failed on: %s", len(requests),
                        ", ".join(f"{q.request_id} (attempt {q.attempts + 1})" for q in requests))
            sent = {id(q) for q in requests}
            self.retries = deque(q for q in self.retries if id(q) not in sent)
            self.sent += [(q.request_id, False) for q in requests]


class PublisherStopped(RuntimeError):
    """A hand-over gave up: the queue is full and the worker is stopping at once."""


Handover = Callable[[Outbox], None]  # one call on the thread's outbox: add, retry or ack


class PublisherThread:
    """An :class:`Outbox` served by a thread of its own; the engine thread's side has the outbox's
    methods (``add``, ``retry``, ``ack``, ``flush``, ``empty``) and makes no Redis call.

    ``add`` / ``retry`` / ``ack`` collect; ``flush`` (once per loop iteration) hands what was
    collected over as one queue item, so a step's rows cost one queue operation. The thread takes
    what is queued, gathers more for up to ``linger_s`` while it holds fewer than a chunk of rows
    (unless the engine thread said ``urgent``: nothing left running, so nothing more is coming soon),
    sends it (:meth:`Outbox.send`, then the acks), and hands the
    confirmed request ids back; ``flush`` (engine thread) tells the book, which names the batches
    now complete, and hands their acks over. A Redis outage leaves everything in the thread's outbox,
    sent again with backoff (every send is idempotent). ``hard_stop`` set: a blocked hand-over
    raises :class:`PublisherStopped` and the thread ends, leaving what is unsent to the leases.
    """

    def __init__(self, outbox: Outbox, *, maxsize: int = QUEUE_SIZE, hard_stop: threading.Event | None = None,
                 name: str = "publisher", poll: Callable[[redis.Redis], None] | None = None,
                 poll_seconds: float = 0.5, linger_s: float = LINGER_S):
        if maxsize < 1:
            raise ValueError(f"PublisherThread: maxsize must be >= 1, got {maxsize}")
        self.outbox = outbox
        self.poll, self.poll_seconds = poll, poll_seconds  # a read run every poll_seconds (cancellations)
        self.hard_stop = hard_stop or threading.Event()
        self._queue: queue.Queue[Handover] = queue.Queue(maxsize)
        self._pending: list[Handover] = []  # collected on the engine thread, handed over by ``flush``
        self._done: deque[tuple[str, bool]] = deque()  # confirmed (request id, a row), for ``flush``
        self._halt = threading.Event()  # stop now (``stop``); ``hard_stop`` stops the thread too
        self.linger_s = linger_s
        self._wake = threading.Event()  # ends a linger: an urgent flush, or ``stop``
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._started = False
        self.blocked_s = 0.0  # engine-thread seconds spent waiting for room in the queue
        self.cpu_s = 0.0  # the thread's CPU seconds so far, as of its last pass (the heartbeat reads it)

    # -- the engine thread's side -----------------------------------------------------------------

    def add(self, row: ResultRow, reply_to: str | None = None, dead_letter: DeadLetter | None = None) -> None:
        self._pending.append(lambda o: o.add(row, reply_to, dead_letter))

    def retry(self, request: BatchRequest) -> None:
        """Collect a retry; the caller tells its book the request is done (its acks queue behind)."""
        self._pending.append(lambda o: o.retry(request))

    def ack(self, entries: list[str]) -> None:
        entries = list(entries)
        self._pending.append(lambda o: o.ack(entries))

    def flush(self, book: Book, urgent: bool = False) -> int:
        """Tell ``book`` the requests confirmed since the last call, collect the acks of the
        batches they complete, and hand everything collected over (blocks while the queue is
        full). ``urgent``: send without lingering (the engine has nothing left running). Returns
        the number of rows confirmed. Never touches Redis."""
        rows, acks = 0, []
        while self._done:
            request_id, is_row = self._done.popleft()
            acks += book.done(request_id)
            rows += is_row
        if acks:
            self.ack(acks)
        if self._pending:
            batch, self._pending = self._pending, []

            def apply_all(outbox: Outbox) -> None:
                for handover in batch:
                    handover(outbox)

            self._put(apply_all)
        if urgent:
            self._wake.set()
        return rows

    def empty(self) -> bool:
        """Nothing collected or handed over is unsent, and ``flush`` took every confirmation."""
        with self._queue.mutex:  # the thread hands confirmations back before it marks items done
            unfinished = self._queue.unfinished_tasks
        return unfinished == 0 and not self._done and not self._pending

    def queued(self) -> int:
        """Hand-overs in the queue, not yet taken by the thread."""
        return self._queue.qsize()

    def stop(self, timeout: float = 5.0) -> None:
        """End the thread now; what it has not sent stays unsent (call when ``empty`` to drain)."""
        self._halt.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        if not self._thread.is_alive():
            disconnect(self.outbox.redis)  # the thread's own connection

    def start(self) -> None:
        """Start the thread (the first hand-over does, too). Engine thread only."""
        if not self._started:
            self._started = True
            self._thread.start()

    def _put(self, handover: Handover) -> None:
        self.start()
        try:
            self._queue.put_nowait(handover)
            return
        except queue.Full:
            pass
        began = time.perf_counter()
        try:
            while True:  # backpressure: wait for room, never drop
                if self.hard_stop.is_set() or self._halt.is_set():
                    raise PublisherStopped("the publisher queue is full and the worker is stopping")
                try:
                    self._queue.put(handover, timeout=0.1)
                    return
                except queue.Full:
                    continue
        finally:
            self.blocked_s += time.perf_counter() - began

    # -- the thread -------------------------------------------------------------------------------

    def _stopping(self) -> bool:
        return self._halt.is_set() or self.hard_stop.is_set()

    def _run(self) -> None:
        backoff = Backoff(BACKOFF_START_S, BACKOFF_CAP_S)
        taken = 0  # hand-overs taken from the queue, not yet marked done
        next_poll = time.monotonic() + self.poll_seconds
        while not self._stopping():
            self.cpu_s = time.thread_time()  # up to the last pass (only this thread can read it)
            if self.poll is not None and time.monotonic() >= next_poll:
                next_poll = time.monotonic() + self.poll_seconds
                try:
                    self.poll(self.outbox.redis)
                except Exception as e:  # noqa: BLE001 - the next poll tries again
                    log.warning("publisher: poll failed (%s: %s)", type(e).__name__, e)
            taken += self._take(wait=self.outbox.empty())
            if self.outbox.empty():
                taken = self._mark_done(taken)
                continue
            if self.linger_s > 0 and len(self.outbox.rows) < self.outbox.chunk:
                self._wake.wait(self.linger_s)  # more rows come with the next steps: one send for them all
            self._wake.clear()
            taken += self._take(wait=False)
            try:
                self.outbox.send()
                self._hand_back()
                self.outbox.send_acks()
                backoff.reset()
            except Exception as e:  # noqa: BLE001 - Redis away (or a bug): back off, never die
                self._hand_back()  # what was confirmed before the failure
                delay = backoff.next()
                if isinstance(e, (redis.ConnectionError, redis.TimeoutError)):
                    log.warning("publisher: Redis unavailable (%s); %d row(s) wait, retrying in %gs", e,
                                len(self.outbox.rows), delay)
                else:
                    log.exception("publisher: unexpected error; retrying in %gs", delay)
                self._halt.wait(delay)
                continue
            if self.outbox.empty():
                taken = self._mark_done(taken)

    def _take(self, wait: bool) -> int:
        """Apply what is queued to the outbox (waiting a little for the first one when ``wait``)."""
        try:
            handover = self._queue.get(timeout=0.05) if wait else self._queue.get_nowait()
        except queue.Empty:
            return 0
        n = 0
        while True:
            handover(self.outbox)
            n += 1
            if n >= self._queue.maxsize:
                return n
            try:
                handover = self._queue.get_nowait()
            except queue.Empty:
                return n

    def _hand_back(self) -> None:
        """Confirmed rows go back to the engine thread; a retry's request was done when handed over
        (``Feeder.engine_failed``): the book may hold its re-read batch by now."""
        self._done.extend(c for c in self.outbox.confirmed if c[1])
        self.outbox.confirmed = []

    def _mark_done(self, taken: int) -> int:
        for _ in range(taken):
            self._queue.task_done()
        return 0
