"""The scheduler's Redis-side waiting room: validated requests between intake and a batch.

The intake stream is one FIFO; fair share needs to see a ten-request job that arrived behind a
million-request one. So the scheduler validates and tokenises intake entries as they come and
moves each (atomically with its XACK + XDEL) into a staging stream per (model, priority, job):

- ``{p}:queue:<model>:<priority>:<job>`` stream: one entry per request, field ``req`` = the
  ``BatchRequest`` JSON (token ids included);
- ``{p}:queues:<model>`` sorted set: the active staging streams of a model, member
  ``<priority>:<job>``, score = priority.

Dispatch reads a bounded window from these streams, packs it, and moves the packed entries into a
batch (MULTI: XADD batch + XDEL staging). A request is therefore always in exactly one of: the
intake group's pending list, a staging stream, the holding area (unknown model) or a batch.

``{p}:held`` (stream) is the holding area of requests for models no worker has registered yet:
their original intake fields plus ``held_from`` (the intake entry id), ``held_until`` (ms) and
``held_model`` (the model it waits for). The MULTI that holds an entry adds 1 to
``{p}:held_models[<model>]`` and to its job's ``held``; the one that releases it (served now,
waited too long, job ended) subtracts 1 from both, so neither ever goes negative.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import redis

from batchinfer.keys import DIRECT, Keys
from batchinfer.protocol import compact_json
from batchinfer.protocol.batches import encode_request
from batchinfer.protocol.rows import BatchRequest
from batchinfer.redis_conn import as_text
from batchinfer.scheduler.packing import PREFIX_SORT_TOKENS, Candidate
from batchinfer.store import replies, scripts


def queue_key(keys: Keys, model: str, member: str) -> str:
    """The staging stream of ``member`` (``<priority>:<job>``) for ``model``."""
    return keys.queue(model, member)


def queues_key(keys: Keys, model: str) -> str:
    """Sorted set of the active staging streams of ``model``."""
    return keys.queues(model)


def held_key(keys: Keys) -> str:
    """The holding area of requests whose model is not (yet) served."""
    return keys.held


def member_for(priority: int, job_id: str | None) -> str:
    return f"{priority}:{job_id or DIRECT}"


def fair_share_group(body: dict[str, Any]) -> str:
    """The packer's fair-share group of a staged request (its ``BatchRequest`` JSON): its tenant's,
    ``tenant:<name>``, shared by all that tenant's jobs (job ids never hold ':', so no job's group
    is ever a tenant's); else its job id, or the pseudo job of direct requests."""
    tenant = body.get("tenant")
    if isinstance(tenant, str) and tenant:
        return f"tenant:{tenant}"
    return body.get("job_id") or DIRECT


def parse_member(member: str) -> tuple[int, str | None]:
    """``(priority, job_id)`` of a staging member; job ids never hold ':' (protocol.valid_job_id)."""
    priority, job = member.split(":", 1)
    return int(priority), (None if job == DIRECT else job)


@dataclass(frozen=True)
class Staged:
    """One staged request: where it is (stream + entry id) and what it is.

    ``raw`` is the request's JSON as staged: a batch takes it as it is, so dispatch never
    rebuilds or re-encodes a request (``body`` is its decoded form, ``request`` the dataclass,
    built only when needed).
    """

    model: str
    member: str
    entry_id: str
    raw: str
    body: dict[str, Any]
    priority: int
    max_model_len: int

    @cached_property
    def request(self) -> BatchRequest:
        return BatchRequest.from_dict(self.body)

    @cached_property
    def candidate(self) -> Candidate:
        """The packing view: cost = prompt + max_tokens (the rest of the context when unbounded);
        an embedding request (``inputs``) costs its inputs' tokens: it generates nothing. Its
        ``job`` is the request's :func:`fair_share_group`."""
        key, job = f"{self.member}/{self.entry_id}", fair_share_group(self.body)
        inputs = self.body.get("inputs")
        if inputs is not None:
            return Candidate(key=key, job=job, priority=self.priority, max_tokens=0,
                             prompt_tokens=sum(len(ids) for ids in inputs),
                             arrival=self.body.get("created_at") or 0)
        tokens = self.body["prompt_token_ids"]
        params = self.body.get("sampling_params") or {}
        max_tokens = params.get("max_tokens")
        if max_tokens is None:
            max_tokens = max(1, self.max_model_len - len(tokens))
        return Candidate(key=key, job=job, priority=self.priority, prompt_tokens=len(tokens),
                         max_tokens=int(max_tokens), arrival=self.body.get("created_at") or 0,
                         prefix=tuple(tokens[:PREFIX_SORT_TOKENS]), seqs=int(params.get("n") or 1))


class Staging:
    """Reads and writes the staging streams of every model."""

    def __init__(self, redis_client: redis.Redis, keys: Keys):
        self.redis = redis_client
        self.keys = keys
        self._prune = scripts.register(redis_client, "prune_queue")

    def add(self, pipe: redis.client.Pipeline, staged: Iterable[tuple[str, int, BatchRequest]]) -> None:
        """Queue each ``(model, priority, request)`` of ``staged`` on ``pipe`` (the caller's MULTI,
        which also acks their intake entries): an XADD each, and one ZADD per model naming its
        queues (a ZADD a request doubled the commands the scheduler packs and Redis runs)."""
        members: dict[str, dict[str, int]] = {}  # model -> member -> priority
        for model, priority, request in staged:
            member = member_for(priority, request.job_id)
            pipe.xadd(queue_key(self.keys, model, member), {"req": encode_request(request)})
            members.setdefault(model, {})[member] = priority
        for model, queues in members.items():
            pipe.zadd(queues_key(self.keys, model), queues)

    def members(self, model: str, limit: int = 4096) -> list[tuple[str, int]]:
        """Active ``(member, priority)`` of ``model``, highest priority first (at most ``limit``)."""
        rows = self.redis.zrevrange(queues_key(self.keys, model), 0, limit - 1, withscores=True)
        return [(as_text(m), int(score)) for m, score in replies.scored(rows)]

    def read(self, model: str, members: list[str], per_member: int, max_model_len: int) -> list[Staged]:
        """Up to ``per_member`` oldest entries of each member's stream; empty streams are pruned."""
        if not members:
            return []
        pipe = self.redis.pipeline(transaction=False)
        for member in members:
            pipe.xrange(queue_key(self.keys, model, member), count=per_member)
        out: list[Staged] = []
        for member, entries in zip(members, pipe.execute(), strict=True):
            if not entries:
                self._prune(keys=[queue_key(self.keys, model, member), queues_key(self.keys, model)],
                            args=[member])
                continue
            priority, _ = parse_member(member)
            for entry_id, entry in entries:
                raw = entry[b"req"].decode()
                eid = as_text(entry_id)
                out.append(Staged(model, member, eid, raw, compact_json.loads(raw), priority, max_model_len))
        return out

    def remove(self, pipe: redis.client.Pipeline, staged: list[Staged]) -> None:
        """XDEL ``staged`` on ``pipe`` (grouped per stream)."""
        by_stream: dict[str, list[str]] = {}
        for s in staged:
            by_stream.setdefault(queue_key(self.keys, s.model, s.member), []).append(s.entry_id)
        for stream, ids in by_stream.items():
            pipe.xdel(stream, *ids)

    def count(self, model: str, limit: int = 4096) -> int:
        """Requests staged for ``model`` (over its first ``limit`` members)."""
        members = self.members(model, limit)
        pipe = self.redis.pipeline(transaction=False)
        for member, _ in members:
            pipe.xlen(queue_key(self.keys, model, member))
        return sum(pipe.execute()) if members else 0

