"""Batches in: XREADGROUP over the worker's batch streams, each entry decoded and checked against the
exactly-once guard, on a thread of its own (:class:`Prefetcher`); the engine thread only takes what
is ready into its book (:meth:`BatchReader.admit`).

A worker serving LoRA adapters reads its model's stream and the adapter streams the
cache-affinity policy picks (:func:`~batchinfer.workers.service.streams.streams_to_read`); a
request read from an adapter's stream runs with that adapter. Requests already published (a
re-delivery of finished work) are done at once; the rest wait in the book while the keeper holds
their batch's lease. A malformed request becomes a ``protocol_error`` row, or a dead letter when
it names no job to answer; an entry that is no batch at all is dead-lettered whole.

The prefetch thread reads as the engine thread's pull did, one read each time the loop asks (the
same rule: the requests held but not started cannot fill the engine's free room), waiting in
Redis only when the worker is idle, and holds at most ``PREFETCH_DEPTH`` reads that the engine
thread has not taken yet, never a read past a ``solo`` batch: a worker hoards no more than it did
when it read on its engine thread, and a read never outlives the ask by more than one round trip
(a batch a failing worker re-dispatches stays for the others). Every entry is held by the keeper
(its lease refreshed) from the moment it is read, so a prefetched batch is covered like any batch
in the book, and left to its lease by a crash or a hard stop.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import orjson
import redis

from batchinfer.keys import WORKERS_GROUP, Keys
from batchinfer.protocol import batches
from batchinfer.protocol.rows import BatchRequest, ResultRow
from batchinfer.redis_conn import Backoff, as_text, disconnect, ensure_group, read_groups
from batchinfer.store import replies
from batchinfer.store.publish import Publisher
from batchinfer.workers.engine.interface import WorkerEngine
from batchinfer.workers.sampling_params import SamplingParams
from batchinfer.workers.service.inflight import Book
from batchinfer.workers.service.keeper import Keeper
from batchinfer.workers.service.outbox import PublisherThread
from batchinfer.workers.service.streams import BatchStreams, split_key, streams_to_read

log = logging.getLogger(__name__)

# What one XREADGROUP gave from one stream: the stream, its entries by key, the last id read (or None)
StreamRead = tuple[str, list[tuple[str, replies.Fields]], bytes | None]

PREFETCH_DEPTH = 1  # reads the prefetch thread may hold that the engine thread has not taken
BACKOFF_START_S, BACKOFF_CAP_S = 0.5, 10.0  # the prefetch thread's waits after a failed read
# After a busy worker's read finds no batch, its next busy read waits this long, doubling while the
# reads stay empty: a fast engine (a CPU step of a few ms) asks every step, and each empty read
# costs its CPU a round trip and two thread switches; a new batch still starts within QUIET_CAP_S.
QUIET_START_S, QUIET_CAP_S = 0.0025, 0.02


@dataclass
class Fetched:
    """A batch entry read, decoded and checked against the guard, for the engine thread's book."""

    entry: str  # the worker's key of the entry (streams.py)
    requests: list[BatchRequest]
    published: list[bool]  # per request: its row is already published (a re-delivery)
    solo: bool = False
    rows: list[ResultRow] = field(default_factory=list)  # protocol_error rows of malformed elements
    # request id -> its SamplingParams, built (and checked) off the engine thread; a request whose
    # parameters do not parse is missing: the engine thread's own try gives it its error row
    params: dict[str, Any] = field(default_factory=dict)


class BatchReader:
    """Reads the batches of ``streams`` as consumer ``name``, for ``book``.

    ``r`` should be a connection of the reader's own (``batchinfer.redis_conn.own_client``): the prefetch
    thread blocks on it in XREADGROUP. Reading and checking (:meth:`read`, :meth:`check`) may run on any
    thread; :meth:`admit` and :meth:`take_pending` only on the engine thread (the book and the outbox's
    hand-overs are its alone).
    """

    def __init__(self, r: redis.Redis, keys: Keys, streams: BatchStreams, *, name: str, engine: WorkerEngine,
                 adapters: list[str], book: Book, keeper: Keeper, outbox: PublisherThread,
                 publisher: Publisher, block_ms: int):
        self.redis, self.keys, self.streams, self.name, self.engine = r, keys, streams, name, engine
        self.adapters, self.book, self.keeper, self.outbox = adapters, book, keeper, outbox
        self.publisher, self.block_ms = publisher, block_ms
        self.task = engine.task
        self.resident = self._read_resident()  # adapters loaded in the engine, as of the last step
        self._next_partition = 0  # the partition a busy worker's next read starts with

    def ensure_groups(self) -> None:
        """Create the group ``workers`` on every stream this worker serves, if needed."""
        for stream in self.streams.all():
            ensure_group(self.redis, stream, WORKERS_GROUP)

    def take_pending(self) -> None:
        """Take back this consumer's pending entries (a restart under the same name). Engine thread,
        before the prefetch thread starts."""
        starts: dict[str, bytes] = dict.fromkeys(self.streams.all(), b"0-0")
        while starts:  # XREADGROUP from an id re-reads this consumer's pending entries, per stream
            more: dict[str, bytes] = {}
            for stream, entries, last in self._read(starts, count=100):
                for key, fields in entries:
                    self.keeper.hold(key)
                    self.admit(self.check(key, fields))
                if last is not None:
                    more[stream] = last
            starts = more

    def read(self, idle: bool, block_ms: int | None) -> list[tuple[str, replies.Fields]]:
        """The next batch of each stream to read now (``idle``: nothing held or running), waiting up
        to ``block_ms`` for one (None: not at all); each entry is held by the keeper at once.

        With partitions, a worker that holds work reads the partitions in turn: first the one after
        the partition that last gave it a batch, then, only if that one had none, all the others in
        one read (at most two round trips; no partition waits behind another's backlog, and a busy
        worker takes one partition's batch, not one of each). An idle one reads them all at once."""
        streams = self.streams_now(idle=idle)
        rounds = [streams]
        if not idle and self.streams.partitions > 1:
            turn = self._next_partition
            rounds = [[s for s in streams if self.streams.partition_of(s) == turn],
                      [s for s in streams if self.streams.partition_of(s) != turn]]
        read: list[tuple[str, replies.Fields]] = []
        for group in rounds:
            got = self._read(dict.fromkeys(group, b">"), block=block_ms)
            read = [e for _stream, entries, _last in got for e in entries]
            if read:
                last = max(self.streams.partition_of(stream) for stream, entries, _ in got if entries)
                self._next_partition = (last + 1) % self.streams.partitions
                break
        for key, _fields in read:
            self.keeper.hold(key)
        return read

    def check(self, entry: str, fields: replies.Fields) -> Fetched:
        """The entry decoded (malformed parts dead-lettered, or made error rows), its requests
        checked against the guard in one round trip, their sampling parameters built."""
        batch = self._decode_batch(entry, fields)
        adapter = split_key(entry)[0]
        if adapter is not None:  # an adapter's stream: its requests run with the adapter
            for q in batch.requests:
                q.lora = q.lora or adapter
        requests = batch.requests
        published = self.publisher.published_mask([(q.job_id, q.idx, q.request_id) for q in requests])
        fetched = Fetched(entry, requests, published, solo=batch.solo, rows=batch.rows)
        if self.task == "generate":
            built: dict[bytes, SamplingParams | None] = {}  # a job's requests mostly share their parameters
            for q, done in zip(requests, published, strict=True):
                if not done and q.task == "generate":
                    fetched.params[q.request_id] = prepared_params(q, built)
        return fetched

    def admit(self, fetched: Fetched) -> None:
        """Into the book (engine thread): a batch with nothing left to run is acked at once."""
        for row in fetched.rows:
            self.outbox.add(row)
        if self.book.add_batch(fetched.entry, fetched.requests, fetched.published, solo=fetched.solo,
                               params=fetched.params):
            self.outbox.ack([fetched.entry])  # nothing left to run (a re-delivery of finished work)

    def streams_now(self, idle: bool) -> list[str]:
        """The streams to read now, in every partition (one XREADGROUP takes at most one batch of each:
        no partition starves): the base alone without adapters, else the affinity policy's."""
        if not self.adapters:
            return self.streams.streams(None)
        picked = streams_to_read(self.adapters, set(self.resident), self.keeper.resident_elsewhere(), idle)
        return [stream for a in picked for stream in self.streams.streams(a)]

    def refresh_resident(self) -> None:
        """Note the adapters the engine has loaded now (a list replaced whole: other threads read it)."""
        self.resident = self._read_resident()

    def _read_resident(self) -> list[str]:
        return list(self.engine.resident_adapters() or []) if self.adapters else []

    def _read(self, starts: dict[str, bytes], count: int = 1, block: int | None = None) -> list[StreamRead]:
        """One XREADGROUP over ``starts`` (stream -> start id): per stream read, its entries (keyed,
        see :mod:`batchinfer.workers.service.streams`) and the last id it returned (None: none)."""
        reply = read_groups(self.redis, starts, WORKERS_GROUP, self.name, count=count, block_ms=block)
        out: list[StreamRead] = []
        for raw_stream, entries in replies.read_pending(reply):
            stream = as_text(raw_stream)
            gone = [eid for eid, f in entries if not f]  # pending to us, but deleted from the stream
            if gone:
                self.redis.xack(stream, WORKERS_GROUP, *gone)
            live = [(self.streams.key(stream, eid), f) for eid, f in entries if f]
            out.append((stream, live, entries[-1][0] if entries else None))
        return out

    def _decode_batch(self, entry: str, fields: replies.Fields) -> _Decoded:
        """The batch entry; malformed requests become error rows, or dead letters when unroutable.

        An entry that is no batch at all is dead-lettered whole and taken as an empty batch.
        """
        try:
            batch = batches.decode(fields)
        except ValueError as e:  # MalformedBatch: the entry is no batch at all
            self._dead_letter(entry, f"malformed batch entry: {e}", fields)
            return _Decoded([], False, [])
        rows = []
        for bad in batch.rejected:
            if bad.route is not None:
                job, idx = bad.route
                rows.append(ResultRow.error("protocol_error", bad.reason, job_id=job, idx=idx,
                                            worker=self.name))
            else:
                self._dead_letter(entry, bad.reason, {b"request": json.dumps(bad.item).encode()})
        return _Decoded(batch.requests, batch.solo, rows)

    def _dead_letter(self, entry: str, error: str, fields: replies.Fields) -> None:
        log.error("worker %s: %s", self.name, error)
        deadletter = self.keys.part(split_key(entry)[2]).deadletter  # the batch's partition's
        self.redis.xadd(deadletter, replies.xadd_fields(
            {**fields, b"error": error.encode(), b"batch": entry.encode(), b"worker": self.name.encode()}))


@dataclass
class _Decoded:
    requests: list[BatchRequest]
    solo: bool
    rows: list[ResultRow]


def prepared_params(request: BatchRequest, built: dict[bytes, SamplingParams | None] | None = None
                    ) -> SamplingParams | None:
    """The request's ``SamplingParams`` as the worker runs them (``final_only``: the worker reads only
    finished outputs), or None when they do not parse (the engine thread's try makes the error row).

    ``built``: the parameters already built for the same raw parameters (keyed by their JSON); a
    request whose raw parameters are there gets a copy instead of a second validation (the same
    values, so the same outcome)."""
    key = _params_key(request.sampling_params) if built is not None else None
    if key is not None and built is not None and key in built:
        known = built[key]
        return None if known is None else known.copy()
    try:
        params: SamplingParams | None = request.params()
    except Exception:  # noqa: BLE001 - reported where the request is started
        params = None
    if params is not None:
        params.output_kind = "final_only"
    if key is not None and built is not None:
        built[key] = params
        return None if params is None else params.copy()  # the one in built stays untouched
    return params


def _params_key(raw: Any) -> bytes | None:
    """Raw sampling parameters as a memo key: their JSON (key order kept, so 1 and 1.0, true and 1
    differ), or None for what orjson cannot encode (then nothing is shared)."""
    try:
        return orjson.dumps(raw)
    except (orjson.JSONEncodeError, TypeError):
        return None


class Prefetcher:
    """The pull on a thread of its own (``prefetch-<worker>``, the reader's connection).

    The engine thread says what it wants after each feed (:meth:`want`: a batch, and whether it is
    idle, or nothing) and takes what is ready (:meth:`take`, which waits only when idle). Each ask
    gets one read, while fewer than ``depth`` reads wait to be taken (none past a ``solo`` batch):
    the engine thread's pull rate, done while it steps. Only an idle ask's read waits in Redis
    (``block_ms``), returning as soon as the scheduler adds a batch. A busy ask that comes within a
    quiet spell after an empty busy read (``QUIET_START_S`` doubling to ``QUIET_CAP_S``, on
    ``clock``) waits for the first ask after it. A Redis error is retried with backoff; an entry
    read but not yet checked is checked again before anything new is read.
    """

    def __init__(self, reader: BatchReader, *, block_ms: int, depth: int = PREFETCH_DEPTH,
                 name: str = "prefetch", clock: Callable[[], float] = time.monotonic):
        if depth < 1:
            raise ValueError(f"Prefetcher: depth must be >= 1, got {depth}")
        self.reader, self.block_ms, self.depth, self.clock = reader, block_ms, depth, clock
        self._quiet_until, self._quiet_s = 0.0, QUIET_START_S  # after an empty busy read
        self.cpu_s = 0.0  # the thread's CPU seconds so far, as of its last read (the heartbeat reads it)
        self._cond = threading.Condition()
        self._ready: deque[list[Fetched]] = deque()  # reads checked, not yet taken
        self._unchecked: list[tuple[str, replies.Fields]] = []  # read and held, a check failed: again
        self._demand: bool | None = None  # a batch is wanted: whether the engine thread is idle
        self._asked = self._served = 0  # asks made, and the ask the last read answered
        self._busy = False  # a read (or its check) is under way
        self._halt = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    # -- the engine thread's side -----------------------------------------------------------------

    def start(self) -> None:
        if not self._thread.is_alive() and not self._halt.is_set():
            self._thread.start()

    def want(self, idle: bool | None) -> None:
        """Ask for one read (``idle``: the engine thread has nothing held or running), or None: none."""
        with self._cond:
            self._demand = idle
            if idle is not None:
                self._asked += 1
                if idle or self.clock() >= self._quiet_until:  # else no read could start: let it sleep
                    self._cond.notify_all()

    def take(self, idle: bool | None = None, wait_s: float = 0.0) -> list[Fetched]:
        """The batches read ahead (at most ``depth`` reads), oldest first; with nothing ready, waits
        up to ``wait_s`` for a read wanted as ``idle``. Clears the demand: :meth:`want` sets it anew."""
        with self._cond:
            if not self._ready and wait_s > 0 and not self._halt.is_set():
                self._demand = bool(idle)
                self._asked += 1
                self._cond.notify_all()
                self._cond.wait_for(lambda: self._ready or self._halt.is_set(), wait_s)
            taken = [f for read in self._ready for f in read]
            self._ready.clear()
            self._demand = None
            if taken:  # room for a read again; clearing the demand alone lets no read start
                self._cond.notify_all()
            return taken

    def forget(self, entries: Iterable[str]) -> list[str]:
        """Drop ready batches whose lease was lost (re-dispatched elsewhere); returns those dropped."""
        lost = set(entries)
        dropped: list[str] = []
        with self._cond:
            for read in self._ready:
                dropped += [f.entry for f in read if f.entry in lost]
                read[:] = [f for f in read if f.entry not in lost]
            self._unchecked = [(k, f) for k, f in self._unchecked if k not in lost]
            self._ready = deque(read for read in self._ready if read)
        return dropped

    def empty(self) -> bool:
        """Nothing read ahead, nothing being read: a drain may end."""
        with self._cond:
            return not (self._ready or self._busy or self._unchecked)

    def num_batches(self) -> int:
        """Batches read ahead and not yet taken (any thread: the heartbeat reports it)."""
        return sum(len(read) for read in list(self._ready))

    def num_requests(self) -> int:
        """Requests of the batches read ahead and not yet taken (any thread)."""
        return sum(len(f.requests) for read in list(self._ready) for f in read)

    def stop(self, timeout: float = 2.0) -> None:
        """No more reads; waits up to ``timeout`` for a read under way. What was read and not taken
        stays pending to this worker (its lease returns it)."""
        self._halt.set()
        with self._cond:
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout)
        if not self._thread.is_alive():
            disconnect(self.reader.redis)

    # -- the thread -------------------------------------------------------------------------------

    def _may_read(self) -> bool:
        """Called holding the lock: whether to read (or check again) now."""
        if self._unchecked:
            return True
        if self._demand is None or self._asked == self._served or len(self._ready) >= self.depth:
            return False
        if not self._demand and self.clock() < self._quiet_until:
            return False  # a busy ask in the quiet spell after an empty read
        return not any(f.solo for read in self._ready for f in read)  # nothing past a solo batch

    def _check(self, key: str, fields: replies.Fields, fetched: list[Fetched]) -> None:
        """Check one entry read into ``fetched``; a Redis error raises (the entry is checked again),
        any other is this entry's: it is let go to its lease, as a pull's error left it."""
        try:
            fetched.append(self.reader.check(key, fields))
        except redis.RedisError:
            raise
        except Exception:  # noqa: BLE001 - a bug, or an entry no check can pass
            log.exception("worker %s: batch %s could not be taken; leaving it to its lease",
                          self.reader.name, key)
            self.reader.keeper.release([key])

    def _run(self) -> None:
        backoff = Backoff(BACKOFF_START_S, BACKOFF_CAP_S)
        while not self._halt.is_set():
            with self._cond:
                self._cond.wait_for(lambda: self._halt.is_set() or self._may_read())
                if self._halt.is_set():
                    return
                idle, unchecked = bool(self._demand), self._unchecked
                self._unchecked, self._busy = [], True
                if not unchecked:
                    self._served = self._asked
            fetched: list[Fetched] = []
            found: int | None = None  # entries a read returned (None: no read, or it failed)
            try:
                if not unchecked:  # only an idle worker waits in Redis for a batch, as the pull did
                    unchecked = self.reader.read(idle, self.block_ms if idle else None)
                    found = len(unchecked)
                while unchecked:
                    self._check(*unchecked[0], fetched)
                    unchecked.pop(0)
                backoff.reset()
                delay = 0.0
            except Exception as e:  # noqa: BLE001 - Redis away (or a bug): back off, never die
                delay = backoff.next()
                if isinstance(e, (redis.ConnectionError, redis.TimeoutError)):
                    log.warning("worker %s: Redis unavailable (%s); reading batches again in %gs",
                                self.reader.name, e, delay)
                else:
                    log.exception("worker %s: reading batches failed; retrying in %gs", self.reader.name,
                                  delay)
            with self._cond:
                self._unchecked = unchecked + self._unchecked
                if fetched:
                    self._ready.append(fetched)
                self._busy = False
                if found == 0 and not idle:
                    self._quiet_until = self.clock() + self._quiet_s
                    self._quiet_s = min(2 * self._quiet_s, QUIET_CAP_S)
                elif found is not None:
                    self._quiet_until, self._quiet_s = 0.0, QUIET_START_S
                self._cond.notify_all()
            self.cpu_s = time.thread_time()  # only this thread can read its own
            if delay:
                self._halt.wait(delay)

