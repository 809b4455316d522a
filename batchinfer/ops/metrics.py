"""Prometheus metrics of the scheduler and worker daemons (docs/operations.md lists them all).

Each daemon owns one :class:`SchedulerMetrics` or :class:`WorkerMetrics` and calls its small
methods from its loop; :mod:`batchinfer.ops.httpserver` serves ``registry`` on ``--metrics-port``.
Metrics kept in Redis (queue depths, intake lag, jobs by status) are read at scrape time by
:class:`QueueCollector`, which only the scheduler registers so that each series has one source.
Counters move only for events that happened in this process; a row counts once, when the
exactly-once publish says this process wrote it.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import redis
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from batchinfer.keys import Keys
from batchinfer.store import queue_state

if TYPE_CHECKING:
    from batchinfer.workers.engine.outputs import StepStats

log = logging.getLogger(__name__)

# ``*_created`` series double a scrape's size and nothing here reads them (rate() needs none).
disable_created_metrics()

STEP_SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
STEP_TOKENS_BUCKETS = (1, 4, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
INFERENCE_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)
E2E_BUCKETS = (0.5, 1, 5, 15, 60, 300, 900, 1800, 3600, 7200, 14400, 43200, 86400)  # includes queueing
BATCH_REQUESTS_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
BATCH_TOKENS_BUCKETS = (64, 256, 1024, 4096, 16384, 65536, 262144, 1048576)
API_SECONDS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
UNKNOWN = "unknown"  # label value of a row whose model could not be read


class Row(Protocol):
    """What the metrics read from a ``batchinfer.protocol.rows.ResultRow``."""

    status: str
    model: str | None
    error_code: str | None
    prompt_tokens: int | None
    cached_tokens: int | None
    created_at: int | None
    started_at: int | None
    finished_at: int | None
    embeddings: list[str] | None  # set on an embedding row


@dataclass(frozen=True)
class Spec:
    kind: type
    doc: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] | None = None


M = ("model",)
SPEC_LABELS = ("model", "method")
# Engine.spec_stats() keys -> the counters they feed: per method, then per engine
SPEC_METHOD_COUNTERS = {"drafts": "batchinfer_spec_drafts_total",
                        "draft_tokens": "batchinfer_spec_draft_tokens_total",
                        "accepted_tokens": "batchinfer_spec_accepted_tokens_total"}
SPEC_STEP_COUNTERS = {"steps": "batchinfer_spec_steps_total",
                      "disabled_steps": "batchinfer_spec_disabled_steps_total"}
# Every metric the daemons update (QueueCollector's scrape-time gauges are listed in it).
C, G, H = Counter, Gauge, Histogram
SPECS: dict[str, Spec] = {
    # both daemons: rows they published
    "batchinfer_requests_completed_total": Spec(C, "Requests answered successfully.", M),
    "batchinfer_requests_failed_total": Spec(
        C, "Requests ended by an error row, by code (cancelled, expired too).", ("model", "code")),
    "batchinfer_requests_dead_lettered_total": Spec(
        C, "Requests moved to the dead-letter stream after too many worker crashes.", M),
    "batchinfer_reply_to_wrong_type_total": Spec(
        C, "Rows not written to a reply_to stream: the key holds another type (the row is still published)."),
    "batchinfer_rows_dropped_total": Spec(
        C, "Result rows not written at all, by reason (no_job: the job has no record, e.g. lost by a "
           "Redis restart without persistence).", ("reason",)),
    # scheduler
    "batchinfer_requests_received_total": Spec(
        C, "Request entries the scheduler read from the intake stream (job op entries not counted)."),
    "batchinfer_pending_requests": Spec(G, "Validated requests waiting in the scheduler to be packed.", M),
    "batchinfer_batches_dispatched_total": Spec(C, "Batches written to a batch stream (re-dispatches too).",
                                                M),
    "batchinfer_batch_requests": Spec(H, "Requests per dispatched batch.", M, BATCH_REQUESTS_BUCKETS),
    "batchinfer_batch_tokens": Spec(H, "Prompt + max_tokens budget per dispatched batch.", M,
                                    BATCH_TOKENS_BUCKETS),
    "batchinfer_lease_reclaims_total": Spec(C, "Batches re-dispatched after their lease expired.", M),
    "batchinfer_lease_reclaimed_requests_total": Spec(
        C, "Unpublished requests taken back from expired leases.", M),
    "batchinfer_scheduler_owner": Spec(
        G, "Partitions whose work this scheduler owns (1 or 0 with one partition; 0: standing by; "
        "docs/scheduler.md)."),
    "batchinfer_scheduler_ownership_taken_total": Spec(
        C, "Partition ownerships this scheduler took (at start, or over from an owner that died, hung or "
        "gave it up)."),
    # worker
    "batchinfer_worker_info": Spec(G, "Always 1; labels say which worker serves what.",
                                   ("worker", "model", "device")),
    "batchinfer_step_duration_seconds": Spec(H, "Wall time of one engine step.", M, STEP_SECONDS_BUCKETS),
    "batchinfer_step_tokens": Spec(H, "Tokens computed in one engine step.", M, STEP_TOKENS_BUCKETS),
    "batchinfer_prompt_tokens_total": Spec(C, "Prompt tokens of requests whose prefill finished.", M),
    "batchinfer_generation_tokens_total": Spec(C, "Tokens generated.", M),
    "batchinfer_time_to_first_token_seconds": Spec(
        H, "From admission into the engine to the first token.", M, TTFT_BUCKETS),
    "batchinfer_request_inference_seconds": Spec(
        H, "From admission into the engine to the last token.", M, INFERENCE_BUCKETS),
    "batchinfer_e2e_request_latency_seconds": Spec(
        H, "From intake to published result (queueing included).", M, E2E_BUCKETS),
    "batchinfer_prefix_cache_queried_tokens_total": Spec(C, "Prompt tokens looked up in the prefix cache.",
                                                         M),
    "batchinfer_prefix_cache_hit_tokens_total": Spec(C, "Prompt tokens found in the prefix cache.", M),
    "batchinfer_running_sequences": Spec(G, "Sequences in the engine's running set.", M),
    "batchinfer_waiting_sequences": Spec(G, "Sequences waiting for admission into the engine.", M),
    "batchinfer_kv_cache_usage_ratio": Spec(G, "Fraction of KV cache blocks in use (0..1).", M),
    "batchinfer_preemptions_total": Spec(C, "Sequences preempted (KV cache full), to be recomputed.", M),
    # worker, speculative decoding; method: the proposer (ngram, suffix, prediction, draft)
    "batchinfer_spec_drafts_total": Spec(C, "Sequence-steps that carried draft tokens.", SPEC_LABELS),
    "batchinfer_spec_draft_tokens_total": Spec(C, "Draft tokens verified by the target model.", SPEC_LABELS),
    "batchinfer_spec_accepted_tokens_total": Spec(C, "Draft tokens accepted (acceptance rate = ratio of "
                                                     "this rate to the draft tokens' rate).", SPEC_LABELS),
    "batchinfer_spec_steps_total": Spec(C, "Engine steps that verified at least one draft.", M),
    "batchinfer_spec_disabled_steps_total": Spec(
        C, "Engine steps without drafts: more sequences ran than speculative_config's "
           "disable_by_batch_size.", M),
    # the HTTP API (batchinfer/api/app.py); route: the path template, e.g. /v1/batches/{batch_id}
    "batchinfer_api_requests_total": Spec(C, "HTTP requests answered, by route, method and status.",
                                          ("route", "method", "status")),
    "batchinfer_api_request_duration_seconds": Spec(H, "From a request's arrival to its response's end.",
                                                    ("route", "method"), API_SECONDS_BUCKETS),
    "batchinfer_api_requests_in_flight": Spec(G, "HTTP requests being answered now (synchronous ones wait "
                                                 "for their model).", ("route",)),
}

# One metric object per (registry, name): the scheduler and a worker may share a registry in one
# process (``batchinfer run``), and then their common counters are one series.
_metrics: weakref.WeakKeyDictionary[CollectorRegistry, dict[str, Any]] = weakref.WeakKeyDictionary()
_metrics_lock = threading.Lock()


def _metric(registry: CollectorRegistry, name: str) -> Any:
    spec = SPECS[name]
    with _metrics_lock:
        table = _metrics.setdefault(registry, {})
        if name not in table:
            extra = {"buckets": spec.buckets} if spec.buckets else {}
            table[name] = spec.kind(name, spec.doc, spec.labels, registry=registry, **extra)
        return table[name]


class _DaemonMetrics:
    """Request outcome counters both daemons publish rows for, and the registry they live in."""

    def __init__(self, registry: CollectorRegistry | None = None):
        own = registry is None
        self.registry = registry if registry is not None else CollectorRegistry()
        if own:  # resident memory, CPU seconds, open fds of this process
            ProcessCollector(registry=self.registry)
        r = self.registry
        self.completed = _metric(r, "batchinfer_requests_completed_total")
        self.failed = _metric(r, "batchinfer_requests_failed_total")
        self.dead_lettered = _metric(r, "batchinfer_requests_dead_lettered_total")
        self.reply_wrong_type = _metric(r, "batchinfer_reply_to_wrong_type_total")
        self.rows_dropped = _metric(r, "batchinfer_rows_dropped_total")
        # completed's child per model, bound once: labels() costs more than the inc of every row
        self._completed_children: dict[str, Any] = {}

    def row_published(self, row: Row) -> None:
        """Count a result row this process published (call only when the publish says it wrote it)."""
        self.rows_published((row,))

    def rows_published(self, rows: Sequence[Row]) -> None:
        """Count result rows this process published: one ``inc`` per model and outcome, not per row
        (a worker's publisher thread counts a publish call's rows at once)."""
        completed: dict[str, int] = {}
        failed: dict[tuple[str, str], int] = {}
        for row in rows:
            model = row.model or UNKNOWN
            if row.status == "completed":
                completed[model] = completed.get(model, 0) + 1
            else:
                outcome = (model, row.error_code or row.status)
                failed[outcome] = failed.get(outcome, 0) + 1
        for model, n in completed.items():
            child = self._completed_children.get(model)
            if child is None:
                child = self._completed_children[model] = self.completed.labels(model=model)
            child.inc(n)
        for (model, code), n in failed.items():
            self.failed.labels(model=model, code=code).inc(n)

    def reply_skipped(self, count: int = 1) -> None:
        """``count`` reply streams were skipped by a publication: the key is not a stream."""
        self.reply_wrong_type.inc(count)

    def row_dropped(self, reason: str, count: int = 1) -> None:
        """``count`` result rows were not written, for ``reason`` (``no_job``: the job has no record)."""
        self.rows_dropped.labels(reason=reason).inc(count)

    def request_dead_lettered(self, model: str | None, count: int = 1) -> None:
        """``count`` requests of ``model`` went to the dead-letter stream."""
        self.dead_lettered.labels(model=model or UNKNOWN).inc(count)

    def render(self) -> bytes:
        """The registry in Prometheus' text format (what ``/metrics`` serves)."""
        return generate_latest(self.registry)


class SchedulerMetrics(_DaemonMetrics):
    """The scheduler's hooks. With ``redis_client`` given, Redis-held queue state is read at each scrape
    (give it a client with a socket timeout, so a hung Redis cannot hang a scrape)."""

    def __init__(self, registry: CollectorRegistry | None = None, redis_client: redis.Redis | None = None,
                 keys: Keys | None = None, max_jobs: int = 10_000):
        super().__init__(registry)
        r = self.registry
        self.received = _metric(r, "batchinfer_requests_received_total")
        self.pending = _metric(r, "batchinfer_pending_requests")
        self.dispatched = _metric(r, "batchinfer_batches_dispatched_total")
        self.batch_requests = _metric(r, "batchinfer_batch_requests")
        self.batch_tokens = _metric(r, "batchinfer_batch_tokens")
        self.reclaims = _metric(r, "batchinfer_lease_reclaims_total")
        self.reclaimed_requests = _metric(r, "batchinfer_lease_reclaimed_requests_total")
        self.owner = _metric(r, "batchinfer_scheduler_owner")
        self.ownership_taken = _metric(r, "batchinfer_scheduler_ownership_taken_total")
        if redis_client is not None:
            self.registry.register(QueueCollector(redis_client, keys or Keys(), max_jobs=max_jobs))

    def intake_read(self, count: int) -> None:
        """``count`` request entries were read from the intake stream."""
        self.received.inc(count)

    def set_pending(self, model: str, count: int) -> None:
        """Requests validated for ``model`` and buffered for packing, now."""
        self.pending.labels(model=model).set(count)

    def batch_dispatched(self, model: str, num_requests: int, num_tokens: int) -> None:
        """A batch of ``num_requests`` requests (``num_tokens`` prompt + max_tokens) was dispatched."""
        self.dispatched.labels(model=model).inc()
        self.batch_requests.labels(model=model).observe(num_requests)
        self.batch_tokens.labels(model=model).observe(num_tokens)

    def set_owner(self, partitions: int, taken: int = 0) -> None:
        """How many partitions this scheduler owns now; ``taken``: how many it has just taken."""
        self.owner.set(partitions)
        if taken:
            self.ownership_taken.inc(taken)

    def lease_reclaimed(self, model: str, num_requests: int) -> None:
        """One expired batch lease was reclaimed, holding ``num_requests`` unpublished requests."""
        self.reclaims.labels(model=model).inc()
        self.reclaimed_requests.labels(model=model).inc(num_requests)


class ThroughputWindow:
    """Tokens per second over the last ``window_s`` seconds (for the heartbeat ``top`` reads)."""

    def __init__(self, window_s: float = 10.0, clock: Callable[[], float] = time.monotonic):
        self.window_s = window_s
        self.clock = clock
        self._events: deque[tuple[float, int]] = deque()
        self._since = clock()
        self._lock = threading.Lock()  # the loop adds, the heartbeat thread reads

    def add(self, count: int) -> None:
        with self._lock:
            self._events.append((self.clock(), count))

    def rate(self) -> float:
        with self._lock:
            now = self.clock()
            while self._events and self._events[0][0] < now - self.window_s:
                self._events.popleft()
            span = min(self.window_s, now - self._since)
            return sum(c for _, c in self._events) / span if span > 0 else 0.0


class WorkerMetrics(_DaemonMetrics):
    """The worker's hooks: engine steps, request timings, engine state, published rows."""

    def __init__(self, model: str, worker: str = "", device: str = "", *,
                 registry: CollectorRegistry | None = None, clock: Callable[[], float] = time.monotonic):
        super().__init__(registry)
        self.model, self.device, self.clock = model, device, clock
        r = self.registry
        _metric(r, "batchinfer_worker_info").labels(worker=worker, model=model, device=device).set(1)

        def mine(name: str) -> Any:  # this worker serves one model: bind its label once
            return _metric(r, name).labels(model=model)

        self.step_seconds = mine("batchinfer_step_duration_seconds")
        self.step_tokens = mine("batchinfer_step_tokens")
        self.prompt_tokens = mine("batchinfer_prompt_tokens_total")
        self.generation_tokens = mine("batchinfer_generation_tokens_total")
        self.ttft = mine("batchinfer_time_to_first_token_seconds")
        self.inference = mine("batchinfer_request_inference_seconds")
        self.e2e = mine("batchinfer_e2e_request_latency_seconds")
        self.prefix_queried = mine("batchinfer_prefix_cache_queried_tokens_total")
        self.prefix_hits = mine("batchinfer_prefix_cache_hit_tokens_total")
        self.running = mine("batchinfer_running_sequences")
        self.waiting = mine("batchinfer_waiting_sequences")
        self.kv_usage = mine("batchinfer_kv_cache_usage_ratio")
        self.preemptions = mine("batchinfer_preemptions_total")
        self._preemptions_seen = 0
        self._kv_usage_set: float | None = None  # the gauge's value (set only when it moves)
        # speculative decoding: (stats key, method or "") -> [bound counter, cumulative value seen]
        self._spec_seen: dict[tuple[str, str], list[Any]] = {}
        self.throughput = ThroughputWindow(clock=clock)
        self._state: dict[str, Any] = {}
        # request id -> [admitted at (clock), first token at or None, tokens seen so far]
        self._inflight: dict[str, list[Any]] = {}

    # -- engine hooks -------------------------------------------------------------------------------
    def request_started(self, request_id: str) -> None:
        """The request was just added to the engine (its TTFT clock starts)."""
        self._inflight[request_id] = [self.clock(), None, 0]

    def request_aborted(self, request_id: str) -> None:
        """The request left the engine without finishing (cancelled, engine error)."""
        self._inflight.pop(request_id, None)

    def step_done(self, outputs: Iterable[Any], seconds: float, *,
                  num_batched_tokens: int | None = None, stats: StepStats | None = None) -> None:
        """Record one ``Engine.step()``: its duration, tokens, and each output's progress.

        ``outputs`` are the step's ``RequestOutput``s (or an embedding engine's
        ``PooledRequestOutput``s: their prompt tokens count when they finish).
        ``num_batched_tokens`` is what the engine computed this step when it reports it; otherwise
        new prompt tokens (cache hits excluded) plus new generated tokens are used.
        ``stats``: the engine's ``step_stats`` of this step. With it, first tokens (TTFT, prompt
        tokens) and generated tokens come from ``stats`` and only finished outputs are read, so
        the requests may run ``final_only``; without it, every running request's cumulative output
        is compared with the previous step's.
        """
        if stats is not None:
            self._step_stats_done(outputs, seconds, num_batched_tokens, stats)
            return
        now = self.clock()
        new_prompt = new_generated = computed_prompt = 0
        inflight = self._inflight  # a hot loop: every running request, every step
        for out in outputs:
            timing = inflight.get(out.request_id)
            if timing is None:  # not admitted through request_started (e.g. metrics enabled late)
                timing = inflight[out.request_id] = [now - seconds, None, 0]
            completions = getattr(out, "outputs", None)
            if completions is None:  # a PooledRequestOutput (embeddings): one prompt pass, no tokens out
                if out.finished:
                    del inflight[out.request_id]
                    new_prompt += out.num_prompt_tokens
                    computed_prompt += out.num_prompt_tokens
                    if out.error is None:
                        self.inference.observe(now - timing[0])
                continue
            seen = (len(completions[0].token_ids) if len(completions) == 1
                    else sum(len(c.token_ids) for c in completions))
            delta = seen - timing[2] if seen > timing[2] else 0
            if delta and timing[1] is None:  # prefill finished: first token
                timing[1] = now
                self.ttft.observe(now - timing[0])
                new_prompt += len(out.prompt_token_ids)
                computed_prompt += len(out.prompt_token_ids) - (out.num_cached_tokens or 0)
            timing[2] = seen
            new_generated += delta
            if out.finished:
                del inflight[out.request_id]
                if all(c.finish_reason != "abort" for c in out.outputs):
                    self.inference.observe(now - timing[0])
        self._record_step(seconds, num_batched_tokens, new_prompt, computed_prompt, new_generated)

    def _step_stats_done(self, outputs: Iterable[Any], seconds: float, num_batched_tokens: int | None,
                         stats: StepStats) -> None:
        """``step_done`` from the engine's step statistics: O(first tokens + finished outputs)."""
        now = self.clock()
        new_prompt = computed_prompt = 0
        inflight = self._inflight
        for first in stats.first_tokens:  # prefill finished: first token
            timing = inflight.get(first.request_id)
            if timing is None:  # not admitted through request_started (e.g. metrics enabled late)
                timing = inflight[first.request_id] = [now - seconds, None, 0]
            if timing[1] is None:
                timing[1] = now
                self.ttft.observe(now - timing[0])
                new_prompt += first.num_prompt_tokens
                computed_prompt += first.num_prompt_tokens - first.num_cached_tokens
        for out in outputs:
            if not out.finished:  # a cumulative output: its progress is in ``stats``
                continue
            timing = inflight.pop(out.request_id, None)
            started = timing[0] if timing is not None else now - seconds
            completions = getattr(out, "outputs", None)
            if completions is None:  # a PooledRequestOutput (embeddings): one prompt pass, no tokens out
                new_prompt += out.num_prompt_tokens
                computed_prompt += out.num_prompt_tokens
                if out.error is None:
                    self.inference.observe(now - started)
            elif all(c.finish_reason != "abort" for c in completions):
                self.inference.observe(now - started)
        self._record_step(seconds, num_batched_tokens, new_prompt, computed_prompt,
                          stats.num_generated_tokens)

    def _record_step(self, seconds: float, num_batched_tokens: int | None, new_prompt: int,
                     computed_prompt: int, new_generated: int) -> None:
        """The step's histograms and counters, from what either ``step_done`` path counted."""
        self.step_seconds.observe(seconds)
        self.step_tokens.observe(num_batched_tokens if num_batched_tokens is not None
                                 else computed_prompt + new_generated)
        # every step calls this: what did not move takes no lock (a decode step has no prompt tokens)
        if new_prompt:
            self.prompt_tokens.inc(new_prompt)
        if new_generated:
            self.generation_tokens.inc(new_generated)
        if new_prompt or new_generated:
            self.throughput.add(new_prompt + new_generated)

    def set_engine_state(self, running: int, waiting: int, kv_usage: float | None = None,
                         preemptions: int | None = None) -> None:
        """The engine's running / waiting sequence counts, KV cache use (0..1) and, when it counts
        them, its cumulative number of preemptions (``Engine.num_preemptions``), now."""
        if preemptions is not None and preemptions > self._preemptions_seen:
            self.preemptions.inc(preemptions - self._preemptions_seen)
            self._preemptions_seen = preemptions
        # called every step: a gauge is set (a lock taken) only when its value moved
        state = self._state
        if state.get("running") != running:
            self.running.set(running)
            state["running"] = running
        if state.get("waiting") != waiting:
            self.waiting.set(waiting)
            state["waiting"] = waiting
        if kv_usage is not None and kv_usage != self._kv_usage_set:
            if not 0.0 <= kv_usage <= 1.0:
                raise ValueError(f"kv_usage must be within 0..1, got {kv_usage}")
            self.kv_usage.set(kv_usage)
            self._kv_usage_set = kv_usage
            state["kv_usage"] = round(kv_usage, 4)

    def set_spec_stats(self, stats: Mapping[str, Any] | None) -> None:
        """The engine's cumulative speculative-decoding counters (``Engine.spec_stats()``), now: their
        growth since the last call moves the ``batchinfer_spec_*`` counters, and the acceptance so far
        goes to the heartbeat. ``{}`` (an engine that never speculates) moves nothing."""
        if not stats:
            return
        drafts = draft_tokens = accepted = 0
        for method, counts in stats.get("methods", {}).items():
            for key, name in SPEC_METHOD_COUNTERS.items():
                self._spec_advance(key, method, name, counts.get(key, 0))
            drafts += counts.get("drafts", 0)
            draft_tokens += counts.get("draft_tokens", 0)
            accepted += counts.get("accepted_tokens", 0)
        for key, name in SPEC_STEP_COUNTERS.items():
            self._spec_advance(key, "", name, stats.get(key, 0))
        if drafts and draft_tokens:  # nothing drafted yet: no rates to show
            self._state.update(spec_acceptance=round(accepted / draft_tokens, 4),
                               spec_accepted_len=round(1 + accepted / drafts, 3))

    def _spec_advance(self, key: str, method: str, name: str, value: int) -> None:
        """Move counter ``name`` (``method``'s child, or the model's for ``""``) to cumulative ``value``."""
        seen = self._spec_seen.get((key, method))
        if seen is None:  # first sight: bind the labels once (this runs every step)
            labels = {"model": self.model, "method": method} if method else {"model": self.model}
            seen = self._spec_seen[(key, method)] = [_metric(self.registry, name).labels(**labels), 0]
        if value > seen[1]:
            seen[0].inc(value - seen[1])
            seen[1] = value

    def rows_published(self, rows: Sequence[Row]) -> None:
        """Count rows this worker published, with their prefix cache use (summed: one ``inc`` each
        a call) and each one's end-to-end latency."""
        super().rows_published(rows)
        queried = hits = 0
        for row in rows:
            if row.status != "completed":
                continue
            if row.prompt_tokens and row.embeddings is None:  # an embedding's prompt pass has no cache
                queried += row.prompt_tokens
                hits += row.cached_tokens or 0
            if row.created_at and row.finished_at and row.finished_at >= row.created_at:
                self.e2e.observe((row.finished_at - row.created_at) / 1000)
        if queried:
            self.prefix_queried.inc(queried)
            self.prefix_hits.inc(hits)

    def heartbeat_fields(self) -> dict[str, Any]:
        """Fields for ``Registry.heartbeat_worker`` info, as ``batchinfer top`` reads them."""
        fields: dict[str, Any] = {"tokens_per_s": round(self.throughput.rate(), 1), **self._state}
        if self.device:
            fields["device"] = self.device
        return fields


QUEUE_GAUGES: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "up": ("batchinfer_redis_up", "1 when the last scrape could read Redis.", ()),
    "lag": ("batchinfer_intake_lag_requests", "Intake entries the scheduler has not read yet.", ()),
    "lag_s": ("batchinfer_intake_lag_seconds", "Age of the oldest intake entry not read yet.", ()),
    "unacked": ("batchinfer_intake_unacked_requests", "Intake entries read, not yet packed in a batch.", ()),
    "queued": ("batchinfer_batches_queued", "Batches not yet pulled by a worker.", M),
    "in_flight": ("batchinfer_batches_in_flight", "Batches pulled by a worker, not yet acknowledged.", M),
    "jobs": ("batchinfer_jobs", "Jobs by status (the most recent jobs, up to a cap).", ("status",)),
    "dead": ("batchinfer_dead_letter_requests", "Entries in the dead-letter stream.", ()),
    "workers": ("batchinfer_live_workers", "Workers with a live heartbeat.", M),
}


class QueueCollector(Collector):
    """Reads queue state from Redis at scrape time; a Redis outage shows as ``batchinfer_redis_up 0``."""

    def __init__(self, redis_client: redis.Redis, keys: Keys, max_jobs: int = 10_000):
        self.redis, self.keys = redis_client, keys
        self.job_counter = queue_state.JobStatusCounter(max_jobs)

    @staticmethod
    def _families() -> dict[str, GaugeMetricFamily]:
        return {key: GaugeMetricFamily(name, doc, labels=labels)
                for key, (name, doc, labels) in QUEUE_GAUGES.items()}

    def describe(self) -> Iterator[GaugeMetricFamily]:
        yield from self._families().values()  # names only: registering must not touch Redis

    def collect(self) -> Iterator[GaugeMetricFamily]:
        f = self._families()
        try:
            state = queue_state.queue_state(self.redis, self.keys)
            jobs = self.job_counter.count(self.redis, self.keys)
            workers = queue_state.live_workers(self.redis, self.keys)
        except (redis.RedisError, OSError) as exc:
            log.warning("metrics: cannot read queue state from Redis: %s", exc)
            f["up"].add_metric([], 0)
            yield f["up"]
            return
        f["up"].add_metric([], 1)
        f["lag"].add_metric([], state.intake.undelivered)
        f["lag_s"].add_metric([], state.intake.lag_seconds())
        f["unacked"].add_metric([], state.intake.unacked)
        for model, stream in state.batches.items():
            f["queued"].add_metric([model], stream.undelivered)
            f["in_flight"].add_metric([model], stream.unacked)
        for status, count in jobs.items():
            f["jobs"].add_metric([status], count)
        f["dead"].add_metric([], state.deadletter)
        per_model: dict[str, int] = dict.fromkeys(state.batches, 0)
        for w in workers:
            per_model[w.model] = per_model.get(w.model, 0) + 1
        for model, count in per_model.items():
            f["workers"].add_metric([model], count)
        yield from f.values()


__all__ = ["QueueCollector", "SchedulerMetrics", "ThroughputWindow", "WorkerMetrics"]
