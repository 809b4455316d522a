"""What a worker holds: its batches, their requests, and which of them are in the engine.

Pure bookkeeping for the worker daemon (no Redis, no engine), so its rules are unit-tested:

- a batch is acknowledged once every one of its requests has a published row;
- a request that arrives in two batches (a re-dispatch after a lost lease) runs once and
  completes both;
- a request of a ``solo`` batch (its last attempt, see ``batchinfer.protocol.batches.retry_batches``)
  waits apart and runs alone: the worker pulls nothing while one is held, finishes what it was
  running, then starts solo requests one at a time in an empty engine;
- after an engine step fails without naming the culprit, :class:`Quarantine` bisects the
  requests that were running: each half runs alone until a single request fails alone (it gets
  an error row) and every other request completes normally.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from batchinfer.protocol.rows import BatchRequest


@dataclass
class Held:
    """One request this worker holds, and the batch entries it belongs to."""

    request: BatchRequest
    entries: set[str] = field(default_factory=set)
    started_at: int | None = None  # ms, once in the engine
    engine_id: str | None = None  # its id inside the engine while it runs
    tries: int = 0  # times it entered the engine (more than once after a failed step)
    params: Any = None  # its SamplingParams, built when it was read; used once (a re-run builds anew)


class Book:
    """Batches held, requests waiting for the engine, requests running in it."""

    def __init__(self) -> None:
        self.batches: dict[str, set[str]] = {}  # entry id -> request ids without a published row
        self.held: dict[str, Held] = {}  # request id -> waiting or running request
        self.waiting: deque[str] = deque()  # request ids not yet in the engine, in arrival order
        self.solo: set[str] = set()  # held requests that run alone (they came in a solo batch)
        self.solo_waiting: deque[str] = deque()  # solo request ids not yet in the engine
        self.running: set[str] = set()
        self.engine_ids: dict[str, str] = {}  # engine id -> request id, while running
        self.closed: set[str] = set()  # rows queued, not yet published

    def add_batch(self, entry_id: str, requests: Iterable[BatchRequest], published: Iterable[bool],
                  solo: bool = False, params: Mapping[str, Any] | None = None) -> bool:
        """Take a batch; requests already published are done. True when nothing is left to run.

        ``solo``: its requests run alone (a request held already becomes solo too). ``params``:
        request id -> sampling parameters prepared for the engine (kept on a newly held request).
        """
        todo = set()
        params = params or {}
        for req, done in zip(requests, published, strict=True):
            if done:
                continue
            todo.add(req.request_id)
            held = self.held.get(req.request_id)
            if held is None:
                self.held[req.request_id] = held = Held(req, params=params.get(req.request_id))
                self.waiting.append(req.request_id)
            if solo and req.request_id not in self.solo:
                self.solo.add(req.request_id)
                self.solo_waiting.append(req.request_id)
            held.entries.add(entry_id)
        if todo:
            self.batches[entry_id] = todo
        return not todo

    def next_waiting(self) -> Held | None:
        """The oldest waiting request that may share the engine (skipping ones finished meanwhile)."""
        return self._next(self.waiting, solo=False)

    def next_solo(self) -> Held | None:
        """The oldest waiting solo request, or None."""
        return self._next(self.solo_waiting, solo=True)

    def _next(self, queue: deque[str], solo: bool) -> Held | None:
        while queue:
            rid = queue.popleft()
            held = self.held.get(rid)
            if held is not None and (rid in self.solo) == solo and rid not in self.running \
                    and rid not in self.closed:
                return held
        return None

    @property
    def holds_solo(self) -> bool:
        """A solo request is held and has no row yet: pull nothing more until it is done."""
        return any(rid not in self.closed for rid in self.solo)

    @property
    def solo_running(self) -> bool:
        return not self.solo.isdisjoint(self.running)

    def start(self, held: Held, now_ms: int) -> str:
        """Mark ``held`` running; returns the id to give the engine.

        A request re-entering the engine gets a fresh id (``<request id>#<try>``), so a late
        output of its earlier, aborted run can never be taken for the new one.
        """
        rid = held.request.request_id
        held.engine_id = rid if held.tries == 0 else f"{rid}#{held.tries}"
        held.tries += 1
        held.started_at = now_ms
        self.running.add(rid)
        self.engine_ids[held.engine_id] = rid
        return held.engine_id

    def resolve(self, engine_id: str) -> Held | None:
        """The running request behind an engine output, or None (finished, aborted, or stale)."""
        held = self.held.get(self.engine_ids.get(engine_id, ""))
        return held if held is not None and held.engine_id == engine_id else None

    def unstart(self, request_ids: Iterable[str]) -> None:
        """Requests taken out of the engine (aborted for bisection): no longer running."""
        for rid in request_ids:
            self.running.discard(rid)
            held = self.held.get(rid)
            if held is not None and held.engine_id is not None:
                self.engine_ids.pop(held.engine_id, None)
                held.engine_id = held.started_at = None

    def close(self, request_id: str) -> None:
        """The request's row is queued: it leaves the engine's books and is never started again."""
        self.unstart([request_id])
        if request_id in self.held:
            self.closed.add(request_id)

    def open_ids(self) -> set[str]:
        """Held requests whose row is not queued yet."""
        return set(self.held) - self.closed

    def done(self, request_id: str) -> list[str]:
        """The request has its row: forget it; returns the batch entries now complete (to ack)."""
        held = self.held.pop(request_id, None)
        self.running.discard(request_id)
        self.closed.discard(request_id)
        self.solo.discard(request_id)
        if held is None:
            return []
        if held.engine_id is not None:
            self.engine_ids.pop(held.engine_id, None)
        complete = []
        for entry in held.entries:
            left = self.batches.get(entry)
            if left is None:
                continue
            left.discard(request_id)
            if not left:
                del self.batches[entry]
                complete.append(entry)
        return sorted(complete)

    def drop_batches(self, entry_ids: Iterable[str]) -> list[str]:
        """Batches this worker lost (re-dispatched elsewhere): drop their requests not yet started.

        Running requests carry on (the publish guard keeps their rows unique). Returns the
        request ids dropped.
        """
        dropped = []
        for entry in entry_ids:
            for rid in self.batches.pop(entry, set()):
                held = self.held.get(rid)
                if held is None:
                    continue
                held.entries.discard(entry)
                if not held.entries and rid not in self.running and rid not in self.closed:
                    del self.held[rid]
                    self.solo.discard(rid)
                    dropped.append(rid)
        return dropped

    def of_jobs(self, job_ids: set[str]) -> list[Held]:
        """Held requests (waiting or running) of the given jobs."""
        return [h for rid, h in self.held.items() if h.request.job_id in job_ids and rid not in self.closed]

    @property
    def entry_ids(self) -> list[str]:
        return list(self.batches)

    @property
    def num_unstarted(self) -> int:
        """Requests held but neither in the engine nor finished (waiting, or in quarantine)."""
        return len(self.held) - len(self.running) - len(self.closed)

    def empty(self) -> bool:
        return not self.held and not self.batches


class Quarantine:
    """Bisection of the requests of a failed engine step.

    While active, the worker runs one group at a time, alone in the engine. A failing group of
    several requests is split in two halves (both go to the front); a failing group of one is the
    culprit. A group that finishes clears its members.
    """

    def __init__(self) -> None:
        self.groups: deque[list[str]] = deque()
        self.current: list[str] | None = None  # the group in the engine

    @property
    def active(self) -> bool:
        return self.current is not None or bool(self.groups)

    def failed(self, running: list[str]) -> str | None:
        """A step failed with ``running`` in the engine: returns the culprit when it is known.

        Otherwise the running requests are split for bisection (the caller aborts them all and
        puts them back to wait).
        """
        self.current = None
        if len(running) == 1:
            return running[0]
        half = len(running) // 2
        self.groups.extendleft([sorted(running)[half:], sorted(running)[:half]])
        return None

    def next_group(self, still_held: set[str]) -> list[str] | None:
        """The next group to run alone (members that finished meanwhile left out), or None."""
        while self.groups:
            group = [rid for rid in self.groups.popleft() if rid in still_held]
            if group:
                self.current = group
                return group
        self.current = None
        return None

    def group_done(self, still_running: set[str]) -> bool:
        """Whether the group in the engine has finished (then the next one may start)."""
        if self.current is None:
            return True
        if any(rid in still_running for rid in self.current):
            return False
        self.current = None
        return True
