"""The engine's side of the worker: held requests in, steps, finished outputs out as rows.

Faults stay local: a request the engine refuses, or whose own output constraint fails while it
decodes (``RequestOutput.error_code``), gets an ``invalid_request`` row; a request the
engine fails on goes back to the batch stream for another try (:meth:`Feeder.engine_failed`), and
gets its ``engine_error`` row (and a dead letter) once it has failed ``max_attempts`` times; a step
that raises without naming its request is bisected (:class:`~batchinfer.workers.service.inflight.Quarantine`)
so that only the culprit counts a failure. Rows, retries and acks go to the publisher thread
(:class:`~batchinfer.workers.service.outbox.PublisherThread`): nothing here calls Redis.

:class:`Cancellations` holds the cancelled jobs and direct requests the publisher thread polls; the
feeder ends their held requests with ``cancelled`` rows (``expired`` ones when the job's completion
window ended).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import redis

from batchinfer.keys import Keys
from batchinfer.ops.metrics import WorkerMetrics
from batchinfer.protocol.entries import CANCEL_KEEP_SECONDS
from batchinfer.protocol.rows import ResultRow, now_ms
from batchinfer.redis_conn import as_text
from batchinfer.store import replies
from batchinfer.store.jobstore import JobField, JobStatus, parse_status
from batchinfer.workers.engine.interface import WorkerEngine
from batchinfer.workers.engine.outputs import PooledRequestOutput, RequestOutput
from batchinfer.workers.engine.tp_ranks import RankFailure
from batchinfer.workers.service.inflight import Book, Held, Quarantine
from batchinfer.workers.service.outbox import DeadLetter, PublisherThread
from batchinfer.workers.service.rows import embedding_row, generation_row
from batchinfer.workers.tools import NEEDS_SPECIAL_TOKENS, ToolSpec, require_parser

log = logging.getLogger(__name__)

Reason = tuple[str, str, str]  # a cancelled request's row: (status, code, message)
REQUEST_CANCELLED: Reason = ("cancelled", "cancelled", "the request was cancelled")  # a direct one


def cancel_reason(status: JobStatus | None) -> Reason:
    """A cancelled job's rows: ``expired`` when its completion window ended, else ``cancelled``."""
    if status is JobStatus.EXPIRED:
        return "expired", "expired", "the job's completion window ended before this request ran"
    return "cancelled", "cancelled", "the job was cancelled"


class Cancellations:
    """The cancelled jobs and why, and the cancelled direct requests, as of the last poll: a snapshot
    the publisher thread replaces whole, which the engine thread takes without a Redis call."""

    def __init__(self, keys: Keys):
        self.keys = keys
        self._reasons: dict[str, Reason] = {}
        self._requests: frozenset[str] = frozenset()
        self._seen = self._reasons
        self.jobs: set[str] = set()  # the cancelled jobs as of the last take()
        self.requests: frozenset[str] = frozenset()  # the cancelled direct requests, as of the last take()

    def poll(self, r: redis.Redis) -> None:
        """Read the cancelled jobs and direct requests (one round trip: each partition's SMEMBERS, and
        a ZRANGEBYSCORE of the last hour's requests), then the jobs' statuses (one pipelined HGET);
        called on the publisher thread with its connection, and once at start."""
        since = now_ms() - CANCEL_KEEP_SECONDS * 1000
        pipe = r.pipeline(transaction=False)
        pipe.zrangebyscore(self.keys.cancelled_requests, since, "+inf")
        for part in self.keys.parts():
            pipe.smembers(part.cancelled)
        requests, *members = pipe.execute()
        jobs = sorted({as_text(m) for reply in members for m in replies.members(reply)})
        for job in jobs:
            pipe.hget(self.keys.job(job), JobField.STATUS)
        statuses = pipe.execute() if jobs else []
        # the requests first: take() sees a new snapshot only once both halves are in place
        self._requests = frozenset(as_text(m) for m in requests)
        self._reasons = {job: cancel_reason(parse_status(s)) for job, s in zip(jobs, statuses, strict=True)}

    def take(self) -> dict[str, Reason] | None:
        """The jobs' snapshot, when a poll replaced it since the last call (``requests`` is then that
        poll's too); else None."""
        reasons = self._reasons
        if reasons is self._seen:
            return None
        self._seen = reasons
        self.jobs = set(reasons)
        self.requests = self._requests
        return reasons

    def cancelled(self, job_id: str | None, request_id: str) -> bool:
        """Whether a request is cancelled: its job, or itself (a direct request), as of the last take()."""
        return job_id in self.jobs if job_id is not None else request_id in self.requests

    def reason(self, job_id: str | None) -> Reason:
        """Why a request of ``job_id`` is cancelled (None: a direct request, cancelled itself)."""
        return REQUEST_CANCELLED if job_id is None else self._reasons.get(job_id, cancel_reason(None))


class Feeder:
    """Feeds ``book``'s waiting requests into ``engine``, steps it, queues each request's row once."""

    def __init__(self, engine: WorkerEngine, book: Book, outbox: PublisherThread, cancels: Cancellations, *,
                 name: str, model: str, max_seqs: int, max_attempts: int, metrics: WorkerMetrics,
                 tool_parser: str | None = None):
        self.engine, self.book, self.outbox, self.cancels = engine, book, outbox, cancels
        self.tool_parser = tool_parser  # the format of `auto` tool calls (--tool-call-parser)
        self.name, self.model, self.task = name, model, engine.task  # "embed": PoolingParams in, vectors out
        self.max_seqs, self.max_attempts, self.metrics = max_seqs, max_attempts, metrics
        self.quarantine = Quarantine()
        self.failed_steps = self.steps = 0
        self.engine_s = 0.0  # perf_counter s inside engine.step() / add_request
        self.rank_failed = False  # a tensor-parallel rank died: the daemon exits at once
        # an engine whose counters are {} now never speculates (WorkerEngine.spec_stats): no call a step
        self.speculates = bool(engine.spec_stats())

    def room(self) -> int:
        """Sequences the engine can take now."""
        return self.max_seqs - self.engine.num_unfinished()

    def feed(self) -> None:
        """Start waiting requests while the engine has room (one group alone while bisecting, a
        solo request alone in an empty engine)."""
        if self.quarantine.active:  # bisecting a failed step: one group alone in the engine
            if self.engine.num_unfinished() == 0 and self.quarantine.group_done(self.book.running):
                for rid in self.quarantine.next_group(self.book.open_ids()) or []:
                    self._add(self.book.held[rid])
            return
        if self.book.solo_running:
            return  # a request on its last attempt runs alone
        room = self.room()
        while room > 0 and (held := self.book.next_waiting()) is not None:
            room -= self._add(held)
        if self.engine.num_unfinished() == 0 and (held := self.book.next_solo()) is not None:
            self._add(held)  # everything else held has finished: the solo request runs alone

    def _add(self, held: Held) -> bool:
        """Put one request into the engine; a request it refuses gets its error row at once."""
        req = held.request
        if self.cancels.cancelled(req.job_id, req.request_id):
            self.end(held, *self.cancels.reason(req.job_id))
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
                # built off this thread when the batch was read (reader.prepared_params); a re-run
                # after a failed step builds them anew (the engine may have kept the first object)
                params, held.params = held.params or req.params(), None
                if req.tools is not None:
                    self._prepare_tools(ToolSpec.from_dict(req.tools), params)
                # Only final outputs are read (the row; metrics take engine.step_stats): the engine
                # builds no per-step output of every running request.
                params.output_kind = "final_only"
                self.engine.add_request(engine_id, prompt_token_ids=req.prompt_token_ids,
                                        sampling_params=params, spec_group=req.job_id, **lora)
            self.engine_s += time.perf_counter() - t0
            self.metrics.request_started(engine_id)
        except ValueError as e:
            self.end(held, "failed", "invalid_request", str(e), started=False)  # it never ran
            return False
        except Exception as e:  # noqa: BLE001 - one request must not stop the worker
            log.exception("worker %s: engine refused %s", self.name, req.request_id)
            self.engine_failed(held, f"{type(e).__name__}: {e}")
            return False
        return True

    def _prepare_tools(self, spec: ToolSpec, params: Any) -> None:
        """Before a request with tools runs: ``auto`` without a parser is refused (ToolParserMissing,
        a ValueError: an ``invalid_request`` row, no generation spent, so that finishing it never
        meets a missing parser), and a parser whose format is
        special tokens (mistral's ``[TOOL_CALLS]``) gets text that keeps them."""
        require_parser(spec, self.tool_parser)
        if spec.choice == "auto" and self.tool_parser in NEEDS_SPECIAL_TOKENS:
            params.skip_special_tokens = False

    def _wrong_task(self, task: str) -> str:
        """Why a request of ``task`` cannot run here (the scheduler routes by task: a batch entry
        written by hand, or a model name re-registered for another task, can still bring one)."""
        mine = "an embedding model" if self.task == "embed" else "a generation model"
        asked = "an embeddings request" if task == "embed" else f"a request of task {task!r}"
        return f"model {self.model!r} is {mine} on worker {self.name}; {asked} cannot run on it"

    def step(self) -> None:
        """One engine step; its finished requests' rows go to the outbox."""
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
        if self.speculates:
            self.metrics.set_spec_stats(engine.spec_stats())
        self.failed_steps = 0
        self.steps += 1

    def _finished(self, out: RequestOutput | PooledRequestOutput, finished_at: int) -> None:
        """A request's final output: its result row, or an engine failure when it carries an error."""
        held = self.book.resolve(out.request_id)
        if held is None:
            return  # aborted by us
        if out.error and getattr(out, "error_code", None) == "invalid_request":
            # the request's own spec failed mid-decode (a grammar over a parser or lexer limit):
            # the same on any worker, so its row now, never a retry or a dead letter
            self.end(held, "failed", "invalid_request", str(out.error))
            return
        if out.error or (isinstance(out, PooledRequestOutput) and out.data is None):
            self.engine_failed(held, str(out.error or "the engine returned no vectors"))
            return
        if isinstance(out, PooledRequestOutput):
            row = embedding_row(held.request, out, worker=self.name, started_at=held.started_at,
                                finished_at=finished_at)
        else:
            # `auto` without a parser never ran (_prepare_tools), so the row's tool calls can be read
            row = generation_row(held.request, out, worker=self.name, started_at=held.started_at,
                                 finished_at=finished_at, tool_parser=self.tool_parser)
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
            self.engine_failed(self.book.held[culprit], f"{type(error).__name__}: {error}")
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

    def end_cancelled(self) -> None:
        """End the held requests of the jobs, and the held direct requests, the last poll found
        cancelled (once per new poll)."""
        reasons = self.cancels.take()
        if reasons is None:
            return
        for held in self.book.of_jobs(self.cancels.jobs):
            self._abort(held)
            self.end(held, *reasons[held.request.job_id or ""])
        if not self.cancels.requests:
            return
        for rid in self.cancels.requests & self.book.open_ids():  # open: no row queued yet
            held = self.book.held[rid]
            if held.request.job_id is None:  # a job's request ids are never intake entry ids
                self._abort(held)
                self.end(held, *REQUEST_CANCELLED)

    # -- rows out ---------------------------------------------------------------------------------

    def end(self, held: Held, status: str, code: str, message: str,
            dead_letter: DeadLetter | None = None, started: bool = True) -> None:
        """The request's error row (``cancelled`` / ``expired`` / ``failed``); ``started_at`` says when
        it entered the engine, if it did (a request aborted while running)."""
        row = ResultRow.error(code, message, status=status, request=held.request, worker=self.name)
        row.started_at = held.started_at if started else None
        self._queue(held, row, dead_letter)

    def _queue(self, held: Held, row: ResultRow, dead_letter: DeadLetter | None = None) -> None:
        self.book.close(held.request.request_id)
        self.outbox.add(row, held.request.reply_to, dead_letter)

    def engine_failed(self, held: Held, error: str) -> None:
        """The engine failed on this request: try it again (anywhere), or give up at ``max_attempts``.

        A failure counts as an attempt, as a worker crash does (``BatchRequest.attempts``): a
        transient fault (a flaky device, an out-of-memory step) does not fail a request that would
        run elsewhere, while a poison request ends after ``max_attempts`` tries.
        """
        req = held.request
        failures = req.attempts + 1
        if failures < self.max_attempts:
            log.warning("worker %s: engine failed on %s (attempt %d of %d): %s; retrying", self.name,
                        req.request_id, failures, self.max_attempts, error)
            self.outbox.retry(req)
            # forgotten now, before the publisher XADDs the retry (which this worker may read back at
            # once); its batches' acks queue behind the retry, so they go out only once it is sent
            if done := self.book.done(req.request_id):
                self.outbox.ack(done)
            return
        message = (f"the engine failed on this request {failures} time(s) (max_attempts "
                   f"{self.max_attempts}); dead-lettered. Last error: {error}")
        log.error("worker %s: %s: %s", self.name, req.request_id, message)
        self.end(held, "failed", "engine_error", message,
                 dead_letter=DeadLetter(req, message, failures, set(held.entries), self.name))
