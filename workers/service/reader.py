"""Batches in: one XREADGROUP over the worker's batch streams, each entry decoded into the book.

A worker serving LoRA adapters reads its model's stream and the adapter streams the
cache-affinity policy picks (:func:`~batchinfer.workers.service.streams.streams_to_read`); a
request read from an adapter's stream runs with that adapter. Requests already published (a
re-delivery of finished work) are done at once; the rest wait in the book while the keeper holds
their batch's lease. A malformed request becomes a ``protocol_error`` row, or a dead letter when
it names no job to answer; an entry that is no batch at all is dead-lettered whole.
"""

from __future__ import annotations

import json
import logging

import redis

from batchinfer.keys import WORKERS_GROUP, Keys
from batchinfer.protocol import batches
from batchinfer.protocol.rows import ResultRow
from batchinfer.redis_conn import as_text, ensure_group, read_groups
from batchinfer.store import replies
from batchinfer.store.publish import Publisher
from batchinfer.workers.engine.interface import WorkerEngine
from batchinfer.workers.service.inflight import Book
from batchinfer.workers.service.keeper import Keeper
from batchinfer.workers.service.outbox import PublisherThread
from batchinfer.workers.service.streams import BatchStreams, split_key, streams_to_read

log = logging.getLogger(__name__)

# What one XREADGROUP gave from one stream: the stream, its entries by key, the last id read (or None)
StreamRead = tuple[str, list[tuple[str, replies.Fields]], bytes | None]


class BatchReader:
    """Reads the batches of ``streams`` as consumer ``name`` into ``book``."""

    def __init__(self, r: redis.Redis, keys: Keys, streams: BatchStreams, *, name: str, engine: WorkerEngine,
                 adapters: list[str], book: Book, keeper: Keeper, outbox: PublisherThread,
                 publisher: Publisher, block_ms: int):
        self.redis, self.keys, self.streams, self.name, self.engine = r, keys, streams, name, engine
        self.adapters, self.book, self.keeper, self.outbox = adapters, book, keeper, outbox
        self.publisher, self.block_ms = publisher, block_ms
        self.resident = self._read_resident()  # adapters loaded in the engine, as of the last step

    def ensure_groups(self) -> None:
        """Create the group ``workers`` on every stream this worker serves, if needed."""
        for stream in self.streams.all():
            ensure_group(self.redis, stream, WORKERS_GROUP)

    def take_pending(self) -> None:
        """Take back this consumer's pending entries (a restart under the same name)."""
        starts: dict[str, bytes] = dict.fromkeys(self.streams.all(), b"0-0")
        while starts:  # XREADGROUP from an id re-reads this consumer's pending entries, per stream
            more: dict[str, bytes] = {}
            for stream, entries, last in self._read(starts, count=100):
                for key, fields in entries:
                    self._take_batch(key, fields)
                if last is not None:
                    more[stream] = last
            starts = more

    def pull(self, block: bool) -> None:
        """Read the next batches: ``block`` (nothing held, nothing running) waits for one."""
        starts = dict.fromkeys(self.streams_now(idle=block), b">")
        for _stream, entries, _last in self._read(starts, block=self.block_ms if block else None):
            for key, fields in entries:
                self._take_batch(key, fields)

    def streams_now(self, idle: bool) -> list[str]:
        """The streams to read now: the base alone without adapters, else the affinity policy's."""
        if not self.adapters:
            return [self.streams.base]
        picked = streams_to_read(self.adapters, set(self.resident), self.keeper.resident_elsewhere(), idle)
        return [self.streams.stream(a) for a in picked]

    def refresh_resident(self) -> None:
        """Note the adapters the engine has loaded now (a list replaced whole: the keeper thread reads it)."""
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

    def _take_batch(self, entry: str, fields: replies.Fields) -> None:
        batch = self._decode_batch(entry, fields)
        adapter = split_key(entry)[0]
        if adapter is not None:  # an adapter's stream: its requests run with the adapter
            for q in batch.requests:
                q.lora = q.lora or adapter
        requests = batch.requests
        published = self.publisher.published_mask([(q.job_id, q.idx, q.request_id) for q in requests])
        if self.book.add_batch(entry, requests, published, solo=batch.solo):
            self.outbox.ack([entry])  # nothing left to run (a re-delivery of finished work)
        else:
            self.keeper.hold(entry)

    def _decode_batch(self, entry: str, fields: replies.Fields) -> batches.BatchEntry:
        """The batch entry; malformed requests become error rows, or dead letters when unroutable.

        An entry that is no batch at all is dead-lettered whole and taken as an empty batch.
        """
        try:
            batch = batches.decode(fields)
        except ValueError as e:  # MalformedBatch: the entry is no batch at all
            self._dead_letter(entry, f"malformed batch entry: {e}", fields)
            return batches.BatchEntry()
        for bad in batch.rejected:
            if bad.route is not None:
                job, idx = bad.route
                row = ResultRow.error("protocol_error", bad.reason, job_id=job, idx=idx, worker=self.name)
                self.outbox.add(row)
            else:
                self._dead_letter(entry, bad.reason, {b"request": json.dumps(bad.item).encode()})
        return batch

    def _dead_letter(self, entry: str, error: str, fields: replies.Fields) -> None:
        log.error("worker %s: %s", self.name, error)
        self.redis.xadd(self.keys.deadletter, replies.xadd_fields(
            {**fields, b"error": error.encode(), b"batch": entry.encode(), b"worker": self.name.encode()}))
