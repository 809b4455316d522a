"""The worker daemon: pull batches for one model, drive an ``Engine`` (or an ``EmbeddingEngine``:
``task == "embed"``, inputs and pooling parameters in, vectors out), publish each result once.

One loop, one screen (:meth:`WorkerDaemon._iteration`): take publication confirmations and hand
complete batches' acks over -> forget batches whose lease was lost -> act on cancellations -> pull
a batch when the engine has room (one batch stays prefetched) -> feed waiting requests into the
engine -> step. Publishing, retries, acks, exports and the cancellation poll run on the publisher
thread (:class:`~batchinfer.workers.service.outbox.PublisherThread`, a Redis connection of its own): the
engine thread hands rows over through a bounded queue and makes no Redis call for them.
Requests from consecutive batches share the engine (continuous batching across batches).

Faults stay local: a request the engine refuses gets an ``invalid_request`` row; a request the
engine fails on goes back to the batch stream for another try, and gets its ``engine_error`` row
(and a dead letter) once it has failed ``max_attempts`` times; a step that raises without naming
its request is bisected (:class:`~batchinfer.workers.service.inflight.Quarantine`) so that only the culprit
counts a failure; Redis outages are retried with backoff while rows wait in the publisher thread's
outbox (:mod:`batchinfer.workers.service.outbox`; publication is idempotent). Only an engine whose every
step fails (``max_failed_steps`` in a row) ends the daemon, with exit code 3: its batches return to
the queue through their leases; so does, at once, a tensor-parallel engine whose rank died
(``RankFailure``); serve.py then closes the engine (its rank processes). SIGTERM drains: no more
pulling, everything held finishes, exit 0; a second SIGTERM / SIGINT stops at once (exit 1; leases
return the batches). The process around the loop (engine, signals, ``/metrics``) is
:mod:`batchinfer.workers.service.serve`.

At start the worker claims its name (a live worker holding it ends ``run`` with
:class:`~batchinfer.store.registry.WorkerNameTaken`) and its served model names (a live worker of
another model serving one: :class:`~batchinfer.store.registry.ServedNameTaken`); see
:meth:`WorkerDaemon._claim_name`.

LoRA adapters: each adapter ``NAME`` the engine serves (``lora_adapters()``) is registered as
model ``BASE:NAME`` with its own batch stream; one XREADGROUP reads the model's stream and the
adapter streams the cache-affinity policy picks (:mod:`batchinfer.workers.service.streams`), and each
request runs with its adapter (``BatchRequest.lora``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import redis

from batchinfer.clock import MONOTONIC, Clock
from batchinfer.config import Settings
from batchinfer.keys import WORKERS_GROUP, Keys
from batchinfer.ops.httpserver import Readiness
from batchinfer.ops.metrics import WorkerMetrics
from batchinfer.protocol import batches
from batchinfer.protocol.rows import ResultRow, now_ms
from batchinfer.redis_conn import Backoff, as_text, ensure_group, read_groups
from batchinfer.store import replies
from batchinfer.store.jobstore import JobField, JobStatus, parse_status
from batchinfer.store.publish import Publisher
from batchinfer.store.registry import (
    NameConflict,
    Registry,
    ServedNameTaken,
    WorkerNameTaken,
    adapter_model_name,
)
from batchinfer.workers.engine.interface import WorkerEngine
from batchinfer.workers.engine.outputs import PooledRequestOutput, RequestOutput
from batchinfer.workers.engine.tp_ranks import RankFailure
from batchinfer.workers.service.inflight import Book, Held, Quarantine
from batchinfer.workers.service.keeper import Keeper
from batchinfer.workers.service.outbox import (
    DeadLetter,
    Outbox,
    PublisherStopped,
    PublisherThread,
    own_connection,
)
from batchinfer.workers.service.rows import embedding_row, generation_row
from batchinfer.workers.service.streams import BatchStreams, split_key, streams_to_read
from batchinfer.workers.service.worker_config import WorkerConfig

log = logging.getLogger(__name__)

BACKOFF_START_S, BACKOFF_CAP_S = 0.5, 10.0  # waits after a failed iteration: 0.5, 1, 2, 4, 8, 10 s
EXIT_ENGINE_BROKEN = 3
# What one XREADGROUP gave from one stream: the stream, its entries by key, the last id read (or None)
StreamRead = tuple[str, list[tuple[str, replies.Fields]], bytes | None]


@runtime_checkable
class EmbedderInfo(Protocol):
    """What an ``"embed"`` engine has besides :class:`WorkerEngine` (see ``WorkerEngine.task``):
    registered with the model, so the scheduler checks ``dimensions`` against it."""

    embedding_dim: int
    matryoshka: bool


class WorkerDaemon:
    """Serves ``engine`` (a :class:`WorkerEngine`: an ``Engine`` or an ``EchoEngine``) under its
    served model names until ``run``'s stop event.

    ``name``, ``model_name``, ``served_model_names`` and ``device`` are those of
    :class:`~batchinfer.workers.service.worker_config.WorkerConfig` (``name`` None: the default,
    unique per process).
    """

    def __init__(self, r: redis.Redis, settings: Settings, engine: WorkerEngine, name: str | None = None,
                 model_name: str | None = None, *, served_model_names: list[str] | None = None,
                 device: str = "cpu",
                 tokenizer_files: dict[str, bytes] | None = None, block_ms: int = 1000,
                 cancel_poll_seconds: float = 0.5, max_failed_steps: int = 32,
                 stall_seconds: float | None = None, hard_stop: threading.Event | None = None,
                 metrics: WorkerMetrics | None = None, readiness: Readiness | None = None,
                 clock: Clock = MONOTONIC):
        config = WorkerConfig(model=engine.model_name, served_model_names=list(served_model_names or []),
                              model_name=model_name, name=name, device=device)
        assert config.name is not None  # WorkerConfig fills in the default
        self.redis, self.settings, self.engine, self.name = r, settings, engine, config.name
        self.config = config
        self.model = config.canonical  # the batch stream's model; requests may name an alias
        self.device = device
        self.instance = uuid.uuid4().hex  # tells this process's registration from another's
        self._claimed = False
        self.keys = Keys(settings.prefix)
        self.adapters = list(engine.lora_adapters() or [])  # LoRA adapters served: BASE:NAME models
        self.streams = BatchStreams(self.keys, self.model, self.adapters)
        self.stream = self.streams.base
        self._resident = self._read_resident()  # adapters loaded in the engine, as of the last step
        self.publisher = Publisher(r, self.keys, direct_retention_s=settings.direct_results_retention_seconds)
        self.capacity = dict(engine.capacity())
        self.task = engine.task  # "embed": PoolingParams in, vectors out
        self.max_seqs = int(self.capacity["max_num_seqs"])
        self.tokenizer_files = tokenizer_files if tokenizer_files is not None else engine.tokenizer_files()
        self.block_ms, self.max_failed_steps = block_ms, max_failed_steps
        self.cancel_poll_seconds = cancel_poll_seconds  # the publisher thread polls this often
        self.hard_stop = hard_stop or threading.Event()
        self.book, self.quarantine = Book(), Quarantine()
        self.cancelled: set[str] = set()
        # Cancelled job -> (status, code, message) of its rows: replaced whole by the publisher thread
        self._cancels: dict[str, tuple[str, str, str]] = {}
        self._seen_cancels = self._cancels
        self.failed_steps = self.steps = self.requests_done = 0
        # Engine-thread time (perf_counter s): in _iteration, inside engine.step()/add_request, and
        # idle (a blocking pull, the nap with nothing to run); the rest is the loop's own overhead.
        self.loop_s = self.engine_s = self.idle_s = 0.0
        self.rank_failed = False  # a tensor-parallel rank died: exit at once (EXIT_ENGINE_BROKEN)
        self.draining = False
        self._ready = False
        self.metrics = metrics or WorkerMetrics(self.model, worker=self.name, device=device)
        self.publisher.metrics = self.metrics  # counts reply streams skipped for their type
        self.readiness = readiness or Readiness()
        self.clock = clock  # leases, heartbeats, the stall and the wait for a dead holder's name
        self.keeper = Keeper(r, self.keys, worker=self.name, model=self.model, status=self.status,
                             register=self._register_model,
                             lease_seconds=settings.lease_seconds, stall_seconds=stall_seconds,
                             heartbeat_seconds=settings.heartbeat_seconds, streams=self.streams, clock=clock)
        # Publishing, retries, acks and exports run on the publisher thread, on a connection of its own
        own = own_connection(r)
        sender = Publisher(own, self.keys, direct_retention_s=settings.direct_results_retention_seconds,
                           metrics=self.metrics)
        outbox = Outbox(own, self.keys, self.streams, sender, enqueue_export=self._enqueue_export,
                        on_published=self.metrics.row_published, on_acked=self.keeper.release,
                        max_attempts=settings.max_attempts)
        self.outbox = PublisherThread(outbox, hard_stop=self.hard_stop, name=f"publisher-{self.name}",
                                      poll=self._read_cancelled, poll_seconds=cancel_poll_seconds)

    # -- the loop ---------------------------------------------------------------------------------

    def run(self, stop: threading.Event) -> int:
        """Serve until ``stop`` is set and everything held is published; returns the exit code.

        Raises :class:`~batchinfer.store.registry.NameConflict` when the worker's name or a served
        model name is a live worker's (nothing was pulled then).
        """
        backoff = Backoff(BACKOFF_START_S, BACKOFF_CAP_S)
        try:
            while not self.hard_stop.is_set():
                self.keeper.tick()
                self.readiness.tick()
                self.draining = stop.is_set()
                if self.draining and self._idle():
                    return 0
                try:
                    if not self._ready:
                        self._start()
                        if not self._ready:
                            continue  # stopped while waiting for the name
                    self._iteration()
                    backoff.reset()
                except NameConflict:
                    raise
                except PublisherStopped:
                    continue  # a hard stop while the publisher queue was full: the loop ends
                except Exception as e:  # noqa: BLE001 - Redis away (or a bug): back off, never die
                    delay = backoff.next()
                    if isinstance(e, (redis.ConnectionError, redis.TimeoutError)):
                        log.warning("worker %s: Redis unavailable (%s); retrying in %gs", self.name, e, delay)
                    else:
                        log.exception("worker %s: unexpected error; retrying in %gs", self.name, delay)
                    self.hard_stop.wait(delay)
                if self.rank_failed:  # _step said why
                    return EXIT_ENGINE_BROKEN
                if self.failed_steps >= self.max_failed_steps:
                    log.critical("worker %s: %d engine steps failed in a row; the engine looks broken, "
                                 "stopping (held batches return through their leases)",
                                 self.name, self.failed_steps)
                    return EXIT_ENGINE_BROKEN
            return 1
        finally:
            self.outbox.stop()  # drained when run returns 0; else what is unsent stays to the leases
            self.keeper.stop()
            if self._claimed:
                with contextlib.suppress(redis.RedisError):  # else the registration expires by itself
                    Registry(self.redis, self.keys).unregister_worker(self.name, self.instance)

    def _iteration(self) -> None:
        began = time.perf_counter()
        try:
            self._flush()
            self._forget_lost()
            self._poll_cancelled()
            if self._wants_batch():
                block = not self.engine.has_unfinished() and self.book.empty()
                t0 = time.perf_counter()
                self._pull(block=block)
                if block:
                    self.idle_s += time.perf_counter() - t0
            self._feed()
            if self.engine.has_unfinished():
                self._step()
            elif self.draining or not self.book.empty():
                time.sleep(0.005)  # nothing the engine can do: rows wait for Redis, or requests for a group
                self.idle_s += 0.005
            if self.adapters:
                self._resident = self._read_resident()  # a list replaced whole: the keeper thread reads it
        finally:
            self.loop_s += time.perf_counter() - began

    @property
    def loop_overhead_s(self) -> float:
        """Engine-thread seconds spent outside engine calls and idle waits: the queue's cost."""
        return max(0.0, self.loop_s - self.engine_s - self.idle_s)

    def _wants_batch(self) -> bool:
        """Pull while the requests held but not started cannot fill the engine's free room: when the
        engine is full, exactly one batch waits prefetched. Never while draining, bisecting or
        holding a solo request (it must run with nothing else held)."""
        if self.draining or self.quarantine.active or self.book.holds_solo:
            return False
        return self.book.num_unstarted < max(1, self._room())

    def _idle(self) -> bool:
        return self.book.empty() and self.outbox.empty()

    def _room(self) -> int:
        return self.max_seqs - self.engine.num_unfinished()

    def _start(self) -> None:
        """Claim the names, register the model, create the group, take back this worker's own
        pending batches."""
        if not self._claim_name():
            return  # hard stop while waiting for the name
        registry = Registry(self.redis, self.keys)
        conflicts = registry.served_name_conflicts(self.config.served_model_names, self.model, self.name)
        if conflicts:
            raise ServedNameTaken(f"worker {self.name}: {conflicts[0]}; give this worker other "
                                  "--served-model-name values, or stop that worker first")
        self._register_model()
        self._ensure_group()
        starts: dict[str, bytes] = dict.fromkeys(self.streams.all(), b"0-0")
        while starts:  # XREADGROUP from an id re-reads this consumer's pending entries, per stream
            more: dict[str, bytes] = {}
            for stream, entries, last in self._read(starts, count=100):
                for key, fields in entries:
                    self._take_batch(key, fields)
                if last is not None:
                    more[stream] = last
            starts = more
        self._read_cancelled(self.redis)  # at once: batches taken from now on know the cancelled jobs
        self.outbox.start()
        self.keeper.start()
        self._ready = True
        self.readiness.mark("serving", True)
        log.info("worker %s serving %s on %s (capacity %s)%s", self.name, self.model, self.device,
                 self.capacity, f" with adapters {', '.join(self.adapters)}" if self.adapters else "")

    def _claim_name(self) -> bool:
        """Take this worker's name in ``{p}:worker:<name>``; False only on a hard stop meanwhile.

        A registration held by another process is either a live worker (its heartbeat advances:
        :class:`WorkerNameTaken`) or this worker's previous run, killed before it unregistered
        (it does not: wait for it to expire, at most its TTL of three heartbeats, then take it).
        The name is this worker's own after a Redis blip in ``_start`` (same ``instance``).
        """
        registry = Registry(self.redis, self.keys)
        beat = self.settings.heartbeat_seconds
        ttl = 3 * beat
        first_beat: int | None = None
        deadline = 0.0
        while not self._claimed:
            holder = registry.claim_worker(self.name, self.instance, self.status(), ttl=ttl)
            if holder is None:
                self._claimed = True
                break
            if first_beat is None:
                first_beat = holder.heartbeat_at
                # a live holder beats again within a third of its TTL; a dead one's expires
                wait = max(ttl, self.redis.pttl(self.keys.worker(self.name)) / 1000)
                deadline = self.clock() + wait + beat
                log.warning("worker %s: the name is registered by another process (pid %s on %s); "
                            "waiting up to %.0fs for its heartbeat to expire", self.name,
                            holder.info.get("pid"), holder.info.get("host"), wait)
            elif holder.heartbeat_at != first_beat or self.clock() > deadline:
                raise WorkerNameTaken(
                    f"worker name {self.name!r} is taken by a live worker (pid {holder.info.get('pid')} on "
                    f"{holder.info.get('host')}, serving {holder.model!r}); give this worker another --name")
            if self.hard_stop.wait(min(1.0, max(0.05, beat / 4))):
                return False
        return True

    def _register_model(self) -> None:
        """Register the model under its canonical name and route its aliases to it (also the
        keeper's re-registration after a Redis restart)."""
        eos = list(self.engine.eos_token_ids)
        registry = Registry(self.redis, self.keys)
        dim, matryoshka = None, False
        if self.task == "embed" and isinstance(self.engine, EmbedderInfo):
            dim, matryoshka = self.engine.embedding_dim, bool(self.engine.matryoshka)
        registry.register_model(self.model, self.tokenizer_files, self.capacity, eos, task=self.task,
                                embedding_dim=dim, matryoshka=matryoshka)
        registry.register_aliases(self.model, self.config.aliases)
        for name in self.adapters:
            model = adapter_model_name(self.model, name)
            registry.register_model(model, self.tokenizer_files, self.capacity, eos, adapter=name)
            registry.register_aliases(model, self._free_adapter_aliases(registry, model, name))

    def _free_adapter_aliases(self, registry: Registry, model: str, name: str) -> list[str]:
        """The aliases of adapter model ``model`` (``NAME``, ``ALIAS:NAME`` per alias of the base)
        no live worker of another model serves; those taken are skipped with a warning: the adapter
        stays reachable as ``BASE:NAME``."""
        free = []
        for alias in [name, *(adapter_model_name(a, name) for a in self.config.aliases)]:
            owner = registry.resolve_alias(alias)
            taken = registry.served_name_conflicts([alias], self.model, self.name)
            if not taken and owner not in (None, model) and registry.live_workers(owner):
                taken = [f"alias {alias!r} routes to model {owner!r}, which a live worker serves"]
            if taken:
                log.warning("worker %s: not serving adapter %r as %r: %s; requests name it %r",
                            self.name, name, alias, taken[0], model)
            else:
                free.append(alias)
        return free

    def _ensure_group(self) -> None:
        for stream in self.streams.all():
            ensure_group(self.redis, stream, WORKERS_GROUP)

    # -- batches in -------------------------------------------------------------------------------

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

    def _pull(self, block: bool) -> None:
        """Read the next batches: ``block`` (nothing held, nothing running) waits for one."""
        starts = dict.fromkeys(self._streams_now(idle=block), b">")
        for _stream, entries, _last in self._read(starts, block=self.block_ms if block else None):
            for key, fields in entries:
                self._take_batch(key, fields)

    def _streams_now(self, idle: bool) -> list[str]:
        """The streams to read now: the base alone without adapters, else the affinity policy's."""
        if not self.adapters:
            return [self.stream]
        picked = streams_to_read(self.adapters, set(self._resident), self.keeper.resident_elsewhere(), idle)
        return [self.streams.stream(a) for a in picked]

    def _read_resident(self) -> list[str]:
        return list(self.engine.resident_adapters() or []) if self.adapters else []

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

    # -- the engine -------------------------------------------------------------------------------

    def _feed(self) -> None:
        if self.quarantine.active:  # bisecting a failed step: one group alone in the engine
            if self.engine.num_unfinished() == 0 and self.quarantine.group_done(self.book.running):
                for rid in self.quarantine.next_group(self.book.open_ids()) or []:
                    self._add(self.book.held[rid])
            return
        if self.book.solo_running:
            return  # a request on its last attempt runs alone
        room = self._room()
        while room > 0 and (held := self.book.next_waiting()) is not None:
            room -= self._add(held)
        if self.engine.num_unfinished() == 0 and (held := self.book.next_solo()) is not None:
            self._add(held)  # everything else held has finished: the solo request runs alone

    def _add(self, held: Held) -> bool:
        """Put one request into the engine; a request it refuses gets its error row at once."""
        req = held.request
        if req.job_id in self.cancelled:
            self._end(held, *self._cancels.get(req.job_id, self._cancel_reason(None)))
            return False
        engine_id = self.book.start(held, now_ms())
        t0 = time.perf_counter()
        try:
            if req.task != self.task:
                raise ValueError(self._wrong_task(req.task))
            if self.task == "embed":
                add: Any = self.engine.add_request  # an embed engine's takes inputs + pooling_params
                add(engine_id, inputs=req.inputs, pooling_params=req.pooling_params or {})
            else:
                lora = {"lora": req.lora} if req.lora is not None else {}  # a base request: as before
                params = req.params()
                # Only final outputs are read (the row; metrics take engine.step_stats): the engine
                # builds no per-step output of every running request.
                params.output_kind = "final_only"
                self.engine.add_request(engine_id, prompt_token_ids=req.prompt_token_ids,
                                        sampling_params=params, **lora)
            self.engine_s += time.perf_counter() - t0
            self.metrics.request_started(engine_id)
        except ValueError as e:
            self._end(held, "failed", "invalid_request", str(e), started=False)  # it never ran
            return False
        except Exception as e:  # noqa: BLE001 - one request must not stop the worker
            log.exception("worker %s: engine refused %s", self.name, req.request_id)
            self._engine_failed(held, f"{type(e).__name__}: {e}")
            return False
        return True

    def _wrong_task(self, task: str) -> str:
        """Why a request of ``task`` cannot run here (the scheduler routes by task: a batch entry
        written by hand, or a model name re-registered for another task, can still bring one)."""
        mine = "an embedding model" if self.task == "embed" else "a generation model"
        asked = "an embeddings request" if task == "embed" else f"a request of task {task!r}"
        return f"model {self.model!r} is {mine} on worker {self.name}; {asked} cannot run on it"

    def _step(self) -> None:
        computed, began = self.engine.num_computed_tokens, time.monotonic()
        t0 = time.perf_counter()
        try:
            outputs = self.engine.step()
            self.engine_s += time.perf_counter() - t0
        except RankFailure as e:  # a tensor-parallel rank is gone: no step can run again here
            log.critical("worker %s: %s; stopping (held batches return through their leases)", self.name, e)
            self.rank_failed = True  # run() stops with EXIT_ENGINE_BROKEN
            return
        except Exception as e:  # noqa: BLE001 - bisect instead of dying
            self._step_failed(e)
            return
        self._step_done(outputs, time.monotonic() - began, self.engine.num_computed_tokens - computed)
        finished_at = now_ms()
        for out in outputs:
            if out.finished:
                self._finished(out, finished_at)

    def _step_done(self, outputs: Sequence[Any], seconds: float, num_batched_tokens: int) -> None:
        engine = self.engine
        self.metrics.step_done(outputs, seconds, num_batched_tokens=num_batched_tokens,
                               stats=engine.step_stats)
        self.metrics.set_engine_state(engine.num_running, engine.num_waiting, engine.kv_usage,
                                      engine.num_preemptions)
        self.failed_steps = 0
        self.steps += 1

    def _finished(self, out: RequestOutput | PooledRequestOutput, finished_at: int) -> None:
        """A request's final output: its result row, or an engine failure when it carries an error."""
        held = self.book.resolve(out.request_id)
        if held is None:
            return  # aborted by us
        if out.error or (isinstance(out, PooledRequestOutput) and out.data is None):
            self._engine_failed(held, str(out.error or "the engine returned no vectors"))
            return
        if isinstance(out, PooledRequestOutput):
            row = embedding_row(held.request, out, worker=self.name, started_at=held.started_at,
                                          finished_at=finished_at)
        else:
            row = generation_row(held.request, out, worker=self.name, started_at=held.started_at,
                                        finished_at=finished_at)
        self._queue(held, row)

    def _step_failed(self, error: Exception) -> None:
        self.failed_steps += 1
        running = sorted(self.book.running)
        log.error("worker %s: engine step failed with %d request(s) running: %s: %s", self.name, len(running),
                  type(error).__name__, error, exc_info=True)
        if not running:
            return
        culprit = self.quarantine.failed(running)
        if culprit is not None:
            self._abort(self.book.held[culprit])
            self._engine_failed(self.book.held[culprit], f"{type(error).__name__}: {error}")
            return
        for rid in running:  # bisect: each half runs alone until the culprit runs alone
            self._abort(self.book.held[rid])
        self.book.unstart(running)

    def _abort(self, held: Held) -> None:
        if held.engine_id is None:
            return
        self.metrics.request_aborted(held.engine_id)
        try:
            self.engine.abort(held.engine_id)
        except Exception:  # noqa: BLE001
            log.exception("worker %s: abort of %s failed", self.name, held.engine_id)

    # -- rows out ---------------------------------------------------------------------------------

    def _end(self, held: Held, status: str, code: str, message: str,
             dead_letter: DeadLetter | None = None, started: bool = True) -> None:
        """The request's error row (``cancelled`` / ``expired`` / ``failed``); ``started_at`` says when
        it entered the engine, if it did (a request aborted while running)."""
        row = ResultRow.error(code, message, status=status, request=held.request, worker=self.name)
        row.started_at = held.started_at if started else None
        self._queue(held, row, dead_letter)

    def _queue(self, held: Held, row: ResultRow, dead_letter: DeadLetter | None = None) -> None:
        self.book.close(held.request.request_id)
        self.outbox.add(row, held.request.reply_to, dead_letter)

    def _engine_failed(self, held: Held, error: str) -> None:
        """The engine failed on this request: try it again (anywhere), or give up at ``max_attempts``.

        A failure counts as an attempt, as a worker crash does (``BatchRequest.attempts``): a
        transient fault (a flaky device, an out-of-memory step) does not fail a request that would
        run elsewhere, while a poison request ends after ``max_attempts`` tries.
        """
        req = held.request
        failures = req.attempts + 1
        if failures < self.settings.max_attempts:
            log.warning("worker %s: engine failed on %s (attempt %d of %d): %s; retrying", self.name,
                        req.request_id, failures, self.settings.max_attempts, error)
            self.outbox.retry(req)
            # forgotten now, before the publisher XADDs the retry (which this worker may read back at
            # once); its batches' acks queue behind the retry, so they go out only once it is sent
            if done := self.book.done(req.request_id):
                self.outbox.ack(done)
            return
        message = (f"the engine failed on this request {failures} time(s) (max_attempts "
                   f"{self.settings.max_attempts}); dead-lettered. Last error: {error}")
        log.error("worker %s: %s: %s", self.name, req.request_id, message)
        self._end(held, "failed", "engine_error", message,
                  dead_letter=DeadLetter(req, message, failures, set(held.entries), self.name))

    def _flush(self) -> None:
        """Take the publisher thread's confirmations: batches they complete go back to it to ack
        (it publishes rows exactly once, re-dispatches failed requests, enqueues exports)."""
        self.requests_done += self.outbox.flush(self.book)

    def _enqueue_export(self, job_id: str) -> None:
        """Called on the publisher thread: its own connection."""
        from batchinfer.jobs.queueing import enqueue_export

        enqueue_export(self.outbox.outbox.redis, self.settings, job_id)

    def _forget_lost(self) -> None:
        lost = self.keeper.take_lost()
        if lost:
            dropped = self.book.drop_batches(lost)
            log.warning("worker %s: dropped %d waiting request(s) of re-dispatched batches",
                        self.name, len(dropped))

    def _poll_cancelled(self) -> None:
        """End the held requests of the jobs the publisher thread's last poll found cancelled (no
        Redis call here: its snapshot is replaced whole)."""
        cancels = self._cancels
        if cancels is self._seen_cancels:
            return
        self._seen_cancels = cancels
        self.cancelled = set(cancels)
        for held in self.book.of_jobs(self.cancelled):
            self._abort(held)
            self._end(held, *cancels[held.request.job_id or ""])

    def _read_cancelled(self, r: redis.Redis) -> None:
        """The cancelled jobs and why (one SMEMBERS, one pipelined HGET of their statuses); called
        on the publisher thread with its connection, and once at start."""
        jobs = sorted(as_text(m) for m in r.smembers(self.keys.cancelled))
        pipe = r.pipeline(transaction=False)
        for job in jobs:
            pipe.hget(self.keys.job(job), JobField.STATUS)
        statuses = pipe.execute() if jobs else []
        reasons = {job: self._cancel_reason(parse_status(s)) for job, s in zip(jobs, statuses, strict=True)}
        self._cancels = reasons

    @staticmethod
    def _cancel_reason(status: JobStatus | None) -> tuple[str, str, str]:
        """A cancelled job's rows: ``expired`` when its completion window ended, else ``cancelled``."""
        if status is JobStatus.EXPIRED:
            return "expired", "expired", "the job's completion window ended before this request ran"
        return "cancelled", "cancelled", "the job was cancelled"

    # -- health -----------------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        """What the heartbeat reports (called from the keeper thread: reads counters only)."""
        running = len(self.book.running)
        return {"model": self.model, "served_model_names": self.config.served_model_names,
                "instance": self.instance,
                "device": self.device, "capacity": self.capacity, "pid": os.getpid(),
                "host": socket.gethostname(), "state": "draining" if self.draining else "serving",
                "running": running, "waiting": len(self.book.held) - running,
                "batches": len(self.book.batches),
                "load": round(min(1.0, self.engine.num_unfinished() / self.max_seqs), 3),
                "requests_done": self.requests_done, "steps": self.steps,
                "loop_overhead_s": round(self.loop_overhead_s, 4), "publisher_queued": self.outbox.queued(),
                "adapters": self.adapters,
                "adapter_models": [self.streams.model_of(a) for a in self.adapters],
                "loras_resident": self._resident,
                **self.metrics.heartbeat_fields()}  # tokens_per_s (prompt + generated), engine state

