"""The worker daemon: pull batches for one model, drive an ``Engine`` (or an ``EmbeddingEngine``:
``task == "embed"``, inputs and pooling parameters in, vectors out), publish each result once.

One loop, one screen (:meth:`WorkerDaemon._iteration`): take publication confirmations and hand
complete batches' acks over -> forget batches whose lease was lost -> act on cancellations -> take
the batch read ahead when the engine has room (one batch stays prefetched) -> feed waiting requests
into the engine -> say whether another batch is wanted -> step. The daemon only loops; the work is
its managers', each testable alone:

- :class:`~batchinfer.workers.service.registration.Registration`: the name claim, the model's
  registration (and its adapters' and aliases'), the farewell;
- :class:`~batchinfer.workers.service.reader.BatchReader`: XREADGROUP over the batch streams,
  batches decoded, checked against the guard and taken into the book
  (:class:`~batchinfer.workers.service.inflight.Book`);
- :class:`~batchinfer.workers.service.reader.Prefetcher` (a thread, a Redis connection of its own):
  the reads and checks, done while the engine steps, at most one read ahead of what the loop asks;
- :class:`~batchinfer.workers.service.feeder.Feeder`: requests into the engine, steps, rows out,
  bisection of a failed step, cancelled jobs ended;
- :class:`~batchinfer.workers.service.keeper.Keeper` (a thread): leases and heartbeats;
- :class:`~batchinfer.workers.service.outbox.PublisherThread` (a thread, a Redis connection of its
  own): publishing, retries, acks, exports and the cancellation poll; the engine thread hands rows
  over through a bounded queue and makes no Redis call for them.

Requests from consecutive batches share the engine (continuous batching across batches). Redis
outages are retried with backoff while rows wait in the publisher thread's outbox (publication is
idempotent). Only an engine whose every step fails (``max_failed_steps`` in a row) ends the daemon,
with exit code 3: its batches return to the queue through their leases; so does, at once, a
tensor-parallel engine whose rank died (``RankFailure``); serve.py then closes the engine (its rank
processes). SIGTERM drains: no more pulling, everything held finishes, exit 0; a second SIGTERM /
SIGINT stops at once (exit 1; leases return the batches). The process around the loop (engine,
signals, ``/metrics``) is :mod:`batchinfer.workers.service.serve`.

At start the worker claims its name (a live worker holding it ends ``run`` with
:class:`~batchinfer.store.registry.WorkerNameTaken`) and its served model names (a live worker of
another model serving one: :class:`~batchinfer.store.registry.ServedNameTaken`).

LoRA adapters: each adapter ``NAME`` the engine serves (``lora_adapters()``) is registered as
model ``BASE:NAME`` with its own batch stream; one XREADGROUP reads the model's stream and the
adapter streams the cache-affinity policy picks (:mod:`batchinfer.workers.service.streams`), and each
request runs with its adapter (``BatchRequest.lora``).

Tool calls: a request with tools has its completions' calls extracted into its row
(:mod:`batchinfer.workers.service.rows`); ``tool_choice: "auto"`` reads them in the format of
``WorkerConfig.tool_call_parser`` (``--tool-call-parser``), else of the model's chat template.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from typing import Any

import redis

from batchinfer.clock import MONOTONIC, Clock
from batchinfer.config import Settings
from batchinfer.ops.httpserver import Readiness
from batchinfer.ops.metrics import WorkerMetrics
from batchinfer.redis_conn import Backoff, own_client
from batchinfer.store.publish import Publisher
from batchinfer.store.registry import NameConflict, PartitionsMismatch, check_partitions
from batchinfer.workers.engine.interface import WorkerEngine
from batchinfer.workers.service.feeder import Cancellations, Feeder
from batchinfer.workers.service.inflight import Book
from batchinfer.workers.service.keeper import Keeper
from batchinfer.workers.service.outbox import Outbox, PublisherStopped, PublisherThread
from batchinfer.workers.service.reader import BatchReader, Prefetcher
from batchinfer.workers.service.registration import Registration
from batchinfer.workers.service.streams import BatchStreams
from batchinfer.workers.service.worker_config import WorkerConfig
from batchinfer.workers.text.tokenizer import Tokenizer
from batchinfer.workers.tools import parser_for_template

log = logging.getLogger(__name__)

BACKOFF_START_S, BACKOFF_CAP_S = 0.5, 10.0  # waits after a failed iteration: 0.5, 1, 2, 4, 8, 10 s
EXIT_ENGINE_BROKEN = 3


def template_tool_parser(files: dict[str, bytes]) -> str | None:
    """The tool-call parser the chat template in the model's tokenizer ``files`` makes unambiguous
    (``parser_for_template``); None without a template, or one that names no known format."""
    if "tokenizer.json" not in files:
        return None
    template = files.get("chat_template.jinja")
    try:
        tokenizer = Tokenizer.from_files(files["tokenizer.json"], files.get("tokenizer_config.json"),
                                         chat_template=template.decode("utf-8") if template else None)
    except ValueError:  # files the registration refuses later, with its own message
        return None
    return parser_for_template(tokenizer.chat_template)


class WorkerDaemon:
    """Serves ``engine`` (a :class:`WorkerEngine`: an ``Engine`` or an ``EchoEngine``) as ``config``
    says (its name, served model names, device and pacing) until ``run``'s stop event.

    ``tokenizer_files`` are registered with the model (None: the engine's); ``hard_stop`` ends
    ``run`` at once; ``clock`` times leases, heartbeats, the stall and the wait for a dead holder's
    name.
    """

    def __init__(self, r: redis.Redis, settings: Settings, engine: WorkerEngine, config: WorkerConfig, *,
                 tokenizer_files: dict[str, bytes] | None = None, hard_stop: threading.Event | None = None,
                 metrics: WorkerMetrics | None = None, readiness: Readiness | None = None,
                 clock: Clock = MONOTONIC):
        assert config.name is not None  # WorkerConfig fills in the default
        self.redis, self.settings, self.engine, self.config = r, settings, engine, config
        self.name, self.model, self.device = config.name, config.canonical, config.device
        self.keys = settings.keys()
        self.adapters = list(engine.lora_adapters() or [])  # LoRA adapters served: BASE:NAME models
        self.streams = BatchStreams(self.keys, self.model, self.adapters)
        self.capacity = dict(engine.capacity())
        self.max_seqs = int(self.capacity["max_num_seqs"])
        self.hard_stop = hard_stop or threading.Event()
        self.metrics = metrics or WorkerMetrics(self.model, worker=self.name, device=self.device)
        self.readiness = readiness or Readiness()
        self.book = Book()
        self.requests_done = 0
        # Engine-thread time (perf_counter s): in _iteration, and idle (a blocking pull, the nap
        # with nothing to run); with the feeder's engine_s, the rest is the loop's own overhead.
        self.loop_s = self.idle_s = 0.0
        self.draining = self._ready = False
        files = tokenizer_files if tokenizer_files is not None else engine.tokenizer_files()
        self.registration = Registration(
            r, self.keys, config, engine, capacity=self.capacity, tokenizer_files=files,
            adapters=self.adapters, heartbeat_seconds=settings.heartbeat_seconds, status=self.status,
            hard_stop=self.hard_stop, clock=clock)
        self.instance = self.registration.instance
        self.keeper = Keeper(r, self.keys, worker=self.name, model=self.model, status=self.status,
                             register=self.registration.register_model,
                             lease_seconds=settings.lease_seconds, stall_seconds=config.stall_seconds,
                             heartbeat_seconds=settings.heartbeat_seconds, streams=self.streams, clock=clock)
        # Publishing, retries, acks and exports run on the publisher thread, on a connection of its own
        own = own_client(r)
        sender = Publisher(own, self.keys, direct_retention_s=settings.direct_results_retention_seconds,
                           metrics=self.metrics, replica_acks=settings.replica_acks,
                           replica_timeout_ms=settings.replica_ack_timeout_ms)
        outbox = Outbox(own, self.keys, self.streams, sender, enqueue_export=self._enqueue_export,
                        on_published=self.metrics.rows_published, on_acked=self.keeper.release,
                        max_attempts=settings.max_attempts)
        self.cancels = Cancellations(self.keys)
        self.outbox = PublisherThread(outbox, hard_stop=self.hard_stop, name=f"publisher-{self.name}",
                                      poll=self.cancels.poll, poll_seconds=config.cancel_poll_seconds)
        # Reads (and their guard checks) run on the prefetch thread, on a connection of its own
        reads = own_client(r)
        self.publisher = Publisher(reads, self.keys, metrics=self.metrics,
                                   direct_retention_s=settings.direct_results_retention_seconds)
        self.reader = BatchReader(reads, self.keys, self.streams, name=self.name, engine=engine,
                                  adapters=self.adapters, book=self.book, keeper=self.keeper,
                                  outbox=self.outbox, publisher=self.publisher, block_ms=config.block_ms)
        self.prefetcher = Prefetcher(self.reader, block_ms=config.block_ms, name=f"prefetch-{self.name}")
        self.tool_parser = config.tool_call_parser or template_tool_parser(files)
        self.feeder = Feeder(engine, self.book, self.outbox, self.cancels, name=self.name, model=self.model,
                             max_seqs=self.max_seqs, max_attempts=settings.max_attempts, metrics=self.metrics,
                             tool_parser=self.tool_parser)

    # -- the loop ---------------------------------------------------------------------------------

    def run(self, stop: threading.Event) -> int:
        """Serve until ``stop`` is set and everything held is published; returns the exit code.

        Raises :class:`~batchinfer.store.registry.NameConflict` when the worker's name or a served
        model name is a live worker's (nothing was pulled then), and
        :class:`~batchinfer.store.registry.PartitionsMismatch` when its ``BATCHINFER_PARTITIONS`` is
        not the deployment's.
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
                except (NameConflict, PartitionsMismatch):
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
                if self.feeder.rank_failed:  # the feeder said why
                    return EXIT_ENGINE_BROKEN
                if self.feeder.failed_steps >= self.config.max_failed_steps:
                    log.critical("worker %s: %d engine steps failed in a row; the engine looks broken, "
                                 "stopping (held batches return through their leases)",
                                 self.name, self.feeder.failed_steps)
                    return EXIT_ENGINE_BROKEN
            return 1
        finally:
            self.prefetcher.stop()  # drained when run returns 0; else what it read stays to the leases
            self.outbox.stop()  # drained when run returns 0; else what is unsent stays to the leases
            self.keeper.stop()
            self.registration.unregister()  # else the registration expires by itself

    def _iteration(self) -> None:
        began = time.perf_counter()
        try:
            self._flush()
            self._forget_lost()
            self.feeder.end_cancelled()
            self._take()
            self.feeder.feed()
            # what the prefetch thread reads while this step runs: the check of the next iteration
            self.prefetcher.want(self._holds_nothing() if self._wants_batch() else None)
            if self.engine.has_unfinished():
                self.feeder.step()
            elif self.draining or not self.book.empty():
                time.sleep(0.005)  # nothing the engine can do: rows wait for Redis, or requests for a group
                self.idle_s += 0.005
            if self.adapters:
                self.reader.refresh_resident()
        finally:
            self.loop_s += time.perf_counter() - began

    def _take(self) -> None:
        """Batches the prefetch thread read into the book, when the engine has room for them (also
        while draining: a read that was under way is finished, not left to its lease). With
        nothing held or running, waits up to ``block_ms`` for one."""
        if not (self.draining or self._wants_batch()):
            return
        idle = not self.draining and self._holds_nothing()
        t0 = time.perf_counter()
        taken = self.prefetcher.take(idle, self.config.block_ms / 1000 if idle else 0.0)
        if idle:
            self.idle_s += time.perf_counter() - t0
        for fetched in taken:
            self.reader.admit(fetched)

    def _holds_nothing(self) -> bool:
        return not self.engine.has_unfinished() and self.book.empty()

    @property
    def loop_overhead_s(self) -> float:
        """Engine-thread seconds spent outside engine calls and idle waits: the queue's cost."""
        return max(0.0, self.loop_s - self.feeder.engine_s - self.idle_s)

    @property
    def steps(self) -> int:
        """Engine steps that succeeded."""
        return self.feeder.steps

    def _wants_batch(self) -> bool:
        """Pull while the requests held but not started cannot fill the engine's free room: when the
        engine is full, exactly one batch waits prefetched. Never while draining, bisecting or
        holding a solo request (it must run with nothing else held)."""
        if self.draining or self.feeder.quarantine.active or self.book.holds_solo:
            return False
        return self.book.num_unstarted < max(1, self.feeder.room())

    def _idle(self) -> bool:
        return self.book.empty() and self.outbox.empty() and self.prefetcher.empty()

    def _start(self) -> None:
        """Claim the names, register the model, create the groups, take back this worker's own
        pending batches."""
        check_partitions(self.redis, self.keys)
        if not self.registration.claim_name():
            return  # hard stop while waiting for the name
        self.registration.check_served_names()
        self.registration.register_model()
        self.reader.ensure_groups()
        self.reader.take_pending()
        self.cancels.poll(self.redis)  # at once: batches taken from now on know the cancelled jobs
        self.outbox.start()
        self.keeper.start()
        self.prefetcher.start()
        self._ready = True
        self.readiness.mark("serving", True)
        adapters = f" with adapters {', '.join(self.adapters)}" if self.adapters else ""
        log.info("worker %s serving %s on %s (capacity %s)%s; tool-call parser %s", self.name, self.model,
                 self.device, self.capacity, adapters,
                 self.tool_parser or "none (tool_choice 'auto' fails: --tool-call-parser)")

    def _flush(self) -> None:
        """Take the publisher thread's confirmations: batches they complete go back to it to ack
        (it publishes rows exactly once, re-dispatches failed requests, enqueues exports)."""
        # urgent with nothing running: the last rows of a wave go out now, not after a linger
        self.requests_done += self.outbox.flush(self.book, urgent=not self.engine.has_unfinished())

    def _enqueue_export(self, job_id: str) -> None:
        """Called on the publisher thread: its own connection."""
        from batchinfer.jobs.queueing import enqueue_export

        enqueue_export(self.outbox.outbox.redis, self.settings, job_id)

    def _forget_lost(self) -> None:
        lost = self.keeper.take_lost()
        if lost:
            self.prefetcher.forget(lost)  # read ahead, not taken yet: nothing of them started
            dropped = self.book.drop_batches(lost)
            log.warning("worker %s: dropped %d waiting request(s) of re-dispatched batches",
                        self.name, len(dropped))

    # -- health -----------------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        """What the heartbeat reports (called from the keeper thread: reads counters only)."""
        running = len(self.book.running)
        return {"model": self.model, "served_model_names": self.config.served_model_names,
                "instance": self.registration.instance,
                "device": self.device, "capacity": self.capacity, "pid": os.getpid(),
                "host": socket.gethostname(), "state": "draining" if self.draining else "serving",
                "running": running, "waiting": len(self.book.held) - running,
                "batches": len(self.book.batches), "prefetched": self.prefetcher.num_batches(),
                "load": round(min(1.0, self.engine.num_unfinished() / self.max_seqs), 3),
                "requests_done": self.requests_done, "steps": self.steps,
                "loop_overhead_s": round(self.loop_overhead_s, 4), "engine_s": round(self.feeder.engine_s, 4),
                "publisher_queued": self.outbox.queued(),
                # the helper threads' CPU seconds: on a CPU engine, time its own cores lend them
                "publisher_cpu_s": round(self.outbox.cpu_s, 4),
                "prefetch_cpu_s": round(self.prefetcher.cpu_s, 4),
                "adapters": self.adapters,
                "adapter_models": [self.streams.model_of(a) for a in self.adapters],
                "loras_resident": self.reader.resident,
                **self.metrics.heartbeat_fields()}  # tokens_per_s (prompt + generated), engine state
