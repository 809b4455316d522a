"""Dispatch: staged requests -> packed batches on ``{p}:batches:<model>``, within backpressure.

Per model, each pass: requests of cancelled / expired jobs leave staging as rows (whether or not
a worker is live); then, if the live workers have fewer than ``BATCHES_PER_WORKER`` undelivered
batches each, a bounded window of staged requests is read, packed (``batchinfer.scheduler.packing``) and
moved into batches in one MULTI (XADD batch + XDEL staging). The rest stays in Redis. Direct requests
of the window that were cancelled (``{p}:cancelled:requests``, ``Client.cancel_request``) leave it as
``cancelled`` rows instead.

A request naming an alias of a model (``--served-model-name``) is staged under the canonical
name it was tokenised for. Dispatch also reads the staging of the model's aliases as one queue
with it (priority and fair share across them), so that requests staged under an alias before an
upgrade (or a name that later became an alias) still reach the model's one batch stream.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import replace

import redis

from batchinfer.keys import WORKERS_GROUP, Keys
from batchinfer.ops.metrics import SchedulerMetrics
from batchinfer.protocol.batches import encode_raw
from batchinfer.protocol.entries import CANCEL_KEEP_SECONDS
from batchinfer.protocol.rows import ResultRow, now_ms
from batchinfer.redis_conn import as_text, ensure_group
from batchinfer.scheduler.lookups import JobCache, ModelCache, RowSink
from batchinfer.scheduler.packing import Budget, Candidate, Packer
from batchinfer.scheduler.staging import Staged, Staging, parse_member
from batchinfer.store import replies, scripts
from batchinfer.store.ownership import Ownership
from batchinfer.store.registry import Registry, WorkerInfo

log = logging.getLogger(__name__)

BATCHES_PER_WORKER = 2  # undelivered batches kept ready per live worker
WINDOW_FACTOR = 2  # candidates read per pass = this x what the batches can hold
MAX_QUEUES = 256  # staging streams read per pass (rotating among equal priorities)
ENDED_ROWS_PER_PASS = 2000  # cancelled / expired rows published per model per pass


def undelivered(r: redis.Redis, stream: str, cap: int) -> int:
    """Entries of ``stream`` the workers' group has not read yet (counted up to ``cap``).

    A lag of 0 is taken as it is; any other lag is counted again in the server
    (``count_after.lua``): after a deleted unread entry Redis 7.0's lag stays too high for good."""
    try:
        groups = r.xinfo_groups(stream)
    except redis.ResponseError:
        return 0  # no stream yet
    for g in groups:
        info = {as_text(k): v for k, v in g.items()}
        if as_text(info.get("name")) != WORKERS_GROUP:
            continue
        if info.get("lag") == 0:
            return 0
        last = as_text(info.get("last-delivered-id", b"0-0"))
        return int(scripts.register(r, "count_after")(keys=[stream], args=[last, cap]))
    return r.xlen(stream)


def worker_budget(workers: list[WorkerInfo], fallback: dict[str, int]) -> Budget:
    """The smallest advertised batch budget among ``workers`` (any of them may take any batch)."""
    caps = [w.capacity for w in workers if w.capacity.get("kv_tokens") and w.capacity.get("max_num_seqs")]
    caps = caps or [fallback]
    return Budget(kv_tokens=min(c["kv_tokens"] for c in caps),
                  max_num_seqs=min(c["max_num_seqs"] for c in caps))


class Dispatcher:
    """Moves staged requests into batches, model by model."""

    def __init__(self, r: redis.Redis, keys: Keys, registry: Registry, models: ModelCache, staging: Staging,
                 jobs: JobCache, sink: RowSink, fence: Ownership, metrics: SchedulerMetrics | None = None):
        """``fence``: batches are written only while this scheduler is the owner."""
        self.redis, self.keys, self.registry, self.models = r, keys, registry, models
        self.fence = fence
        self.staging, self.jobs, self.sink, self.metrics = staging, jobs, sink, metrics
        self.packers: dict[str, Packer] = defaultdict(Packer)
        self.rotation: dict[str, int] = defaultdict(int)
        self.grouped: set[str] = set()  # batch streams whose workers' group exists (reset on reconnect)

    def step(self) -> int:
        """One pass over every registered model; returns the number of batches dispatched."""
        aliases: dict[str, list[str]] = defaultdict(list)
        for alias, model in sorted(self.registry.aliases().items()):
            aliases[model].append(alias)
        return sum(self.dispatch(model, aliases.get(model, [])) for model in self.registry.models())

    def dispatch(self, model: str, aliases: list[str] | None = None) -> int:
        """Batches for ``model`` from the staging of ``model`` and of its ``aliases``."""
        names = [model, *(aliases or [])]
        members = [(name, member, priority)
                   for name in names for member, priority in self.staging.members(name)]
        members = self._drop_ended(members)
        if not members:
            self.packers.pop(model, None)
            return 0
        served = self.models.get(model)
        workers = [w for w in self.registry.live_workers(model) if w.info.get("state") != "draining"]
        if served is None or not workers:
            return 0  # requests wait in staging until a worker serves the model
        stream = self.keys.batches(model)
        if stream not in self.grouped:
            ensure_group(self.redis, stream, WORKERS_GROUP)
            self.grouped.add(stream)
        target = BATCHES_PER_WORKER * len(workers)
        want = target - undelivered(self.redis, stream, cap=target)
        if want <= 0:
            return 0
        budget = worker_budget(workers, served.info.capacity)
        chosen = self._choose(model, members)
        window = want * budget.max_num_seqs * WINDOW_FACTOR
        per_member = max(1, -(-window // len(chosen)))
        staged = [s for name in names
                  for s in self.staging.read(name, [m for n, m in chosen if n == name], per_member,
                                             served.info.max_model_len)]
        staged = self._drop_cancelled(staged)
        candidates = [(_candidate(s, model), s) for s in staged]
        by_key = {c.key: s for c, s in candidates}
        batches = self.packers[model].pack([c for c, _ in candidates], budget, want)
        if not batches:
            return 0
        pipe = self.fence.transaction()
        for batch in batches:
            chosen_staged = [by_key[c.key] for c in batch]
            pipe.xadd(stream, replies.xadd_fields(encode_raw([s.raw for s in chosen_staged])))
            self.staging.remove(pipe, chosen_staged)
        pipe.execute()
        if self.metrics is not None:
            for batch in batches:
                self.metrics.batch_dispatched(model, len(batch), sum(c.cost for c in batch))
            self.metrics.set_pending(model, len(staged) - sum(len(b) for b in batches))
        log.debug("model %s: dispatched %d batch(es) of %s requests", model, len(batches),
                  [len(b) for b in batches])
        return len(batches)

    def _choose(self, model: str, members: list[tuple[str, str, int]]) -> list[tuple[str, str]]:
        """Up to MAX_QUEUES ``(name, member)``, highest priority first, rotating within a priority."""
        by_priority: dict[int, list[tuple[str, str]]] = defaultdict(list)
        for name, member, priority in members:
            by_priority[priority].append((name, member))
        turn = self.rotation[model]
        self.rotation[model] = turn + 1
        chosen: list[tuple[str, str]] = []
        for priority in sorted(by_priority, reverse=True):
            level = by_priority[priority]
            k = turn % len(level)
            chosen.extend((level[k:] + level[:k])[: MAX_QUEUES - len(chosen)])
            if len(chosen) >= MAX_QUEUES:
                break
        return chosen

    def _drop_ended(self, members: list[tuple[str, str, int]]) -> list[tuple[str, str, int]]:
        """Publish ``cancelled`` / ``expired`` rows for staged requests of ended jobs; the live rest
        (``(name, member, priority)``: ``name`` is the model or alias the requests were staged under)."""
        jobs = {m: parse_member(m)[1] for _, m, _ in members}
        views = self.jobs.get_many([j for j in jobs.values() if j])
        budget, live = ENDED_ROWS_PER_PASS, []
        for name, member, priority in members:
            job = jobs[member]
            ended = views[job].ended_as() if job else None
            if ended is None:
                live.append((name, member, priority))
            elif budget > 0:
                staged = self.staging.read(name, [member], budget, max_model_len=1)
                for s in staged:
                    self.sink.publish(ResultRow.error(ended, f"the job was {ended} before this request ran",
                                                      status=ended, request=s.request), s.request.reply_to)
                pipe = self.fence.transaction()
                self.staging.remove(pipe, staged)
                pipe.execute()
                budget -= len(staged)
                if staged:
                    log.info("job %s: %d staged request(s) %s", job, len(staged), ended)
        return live


    def _drop_cancelled(self, staged: list[Staged]) -> list[Staged]:
        """Publish ``cancelled`` rows for the cancelled direct requests of ``staged`` and unstage them;
        the rest. One ZRANGEBYSCORE, only when the window holds direct requests."""
        if all(s.body.get("job_id") is not None for s in staged):
            return staged
        since = now_ms() - CANCEL_KEEP_SECONDS * 1000
        found = replies.members(self.redis.zrangebyscore(self.keys.cancelled_requests, since, "+inf"))
        cancelled = {as_text(m) for m in found}
        gone = [s for s in staged if s.body.get("job_id") is None and s.body.get("request_id") in cancelled]
        if not gone:
            return staged
        for s in gone:
            self.sink.publish(ResultRow.error("cancelled", "the request was cancelled before it ran",
                                              status="cancelled", request=s.request), s.request.reply_to)
        pipe = self.fence.transaction()
        self.staging.remove(pipe, gone)
        pipe.execute()
        log.info("%d cancelled direct request(s) unstaged", len(gone))
        dropped = {(s.model, s.member, s.entry_id) for s in gone}
        return [s for s in staged if (s.model, s.member, s.entry_id) not in dropped]


def _candidate(staged: Staged, model: str) -> Candidate:
    """The packing view of ``staged``; keys of an alias's staging name the alias (entry ids of two
    staging streams may be equal)."""
    c = staged.candidate
    return c if staged.model == model else replace(c, key=f"{staged.model}/{c.key}")
