"""Batch packing policy: which pending requests go into the next batches of one model. Pure.

Two phases per call:

1. *Selection* — strict priority (higher first), then fair share across jobs within a priority:
   the job that has been served the fewest tokens so far goes next (least attained service); a
   job that (re)appears starts level with the least-served active job, so it neither jumps the
   queue with stale credit nor waits behind a million-request job's history. Within a job,
   arrival order. A "job" here is a fair-share group (``Candidate.job``): the jobs of one tenant
   form one group, so a tenant with many jobs gets no more than a tenant with one.
   Each pick is placed first fit into ``max_batches`` bins, each bin within
   ``kv_tokens`` (sum of prompt + n * max_tokens) and ``max_num_seqs`` (sum of n: a request's
   ``n`` sequences cost its job's fair share as ``n`` requests would); a job whose next request
   fits nowhere sits out the rest of the call. A request larger than ``kv_tokens`` gets a bin of
   its own.
2. *Arrangement* — the selected requests are sorted by priority, then by their first KV block of
   prompt tokens (requests sharing a prefix land in one batch, for the workers' prefix cache),
   then by length bucket (similar lengths together), then by a longer prefix, and cut into
   batches in that order. If that cut needs more batches than the bins did, the bins are kept
   (each sorted the same way): everything selected is packed.

Requests that are not packed stay pending (in Redis) for a later call.
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

PREFIX_BLOCK_TOKENS = 16  # a KV block: the unit the workers' prefix cache shares
PREFIX_SORT_TOKENS = 64  # tokens compared when ordering requests within a group


@dataclass(frozen=True)
class Budget:
    """What one batch may hold: ``kv_tokens`` of prompt + max_tokens over ``max_num_seqs`` requests."""

    kv_tokens: int
    max_num_seqs: int

    def __post_init__(self) -> None:
        if self.kv_tokens <= 0 or self.max_num_seqs <= 0:
            raise ValueError(f"budget must be positive, got kv_tokens={self.kv_tokens}, "
                             f"max_num_seqs={self.max_num_seqs}")


@dataclass(frozen=True)
class Candidate:
    """A validated, tokenised request waiting for a batch."""

    key: str  # unique among the candidates of one call (the scheduler uses the staging entry id)
    job: str  # fair-share group: the job id, its tenant's group (staging.fair_share_group), or direct
    priority: int
    prompt_tokens: int
    max_tokens: int
    arrival: int  # ms since the epoch, or any increasing sequence number
    prefix: tuple[int, ...] = field(default=(), compare=False)  # the first PREFIX_SORT_TOKENS tokens
    seqs: int = 1  # sequences it runs (its n): each holds a slot of max_num_seqs and its own output

    @property
    def cost(self) -> int:
        """KV tokens the request may occupy in a worker: the prompt (shared by its sequences through
        the prefix cache) + max_tokens for each sequence."""
        return self.prompt_tokens + self.seqs * self.max_tokens


class Packer:
    """Packs candidates into batches; remembers tokens served per job for fair share."""

    def __init__(self) -> None:
        self.served: dict[str, int] = {}  # tokens packed per job, among jobs still pending

    def pack(self, candidates: Iterable[Candidate], budget: Budget,
             max_batches: int) -> list[list[Candidate]]:
        """At most ``max_batches`` batches of ``candidates`` (see the module docstring)."""
        pending = list(candidates)
        if max_batches <= 0 or not pending:
            return []
        self._forget_absent({c.job for c in pending})
        batches = arrange(self._select(pending, budget, max_batches), budget)
        for batch in batches:
            for c in batch:
                self.served[c.job] = self.served.get(c.job, 0) + c.cost
        return batches

    def _forget_absent(self, jobs: set[str]) -> None:
        """Drop jobs with nothing pending; newcomers start level with the least-served job."""
        for job in [j for j in self.served if j not in jobs]:
            del self.served[job]
        floor = min(self.served.values(), default=0)
        for job in jobs:
            self.served.setdefault(job, floor)

    def _select(self, pending: list[Candidate], budget: Budget, max_batches: int) -> list[list[Candidate]]:
        """Fair-share order, placed first fit into ``max_batches`` bins (so every pick fits)."""
        bins: list[list[Candidate]] = [[] for _ in range(max_batches)]
        tokens = [0] * max_batches
        seqs = [0] * max_batches  # each bin's sequences, kept as it fills (summed per try: O(n²))
        by_level: dict[int, dict[str, deque[Candidate]]] = defaultdict(lambda: defaultdict(deque))
        for c in sorted(pending, key=lambda c: (c.arrival, c.key)):
            by_level[c.priority][c.job].append(c)
        served = dict(self.served)  # selection charges a scratch copy; pack() charges what it packs
        for priority in sorted(by_level, reverse=True):
            queues = by_level[priority]
            while queues:
                job = min(queues, key=lambda j: (served[j], queues[j][0].arrival, j))
                head = queues[job][0]
                slot = next((i for i, b in enumerate(bins) if fits(b, tokens[i], head, budget, seqs[i])),
                            None)
                if slot is None:
                    if all(n >= budget.max_num_seqs or t >= budget.kv_tokens
                           for n, t in zip(seqs, tokens, strict=True)):
                        return [b for b in bins if b]  # every bin is full
                    del queues[job]  # its head does not fit this time; the others may
                    continue
                queues[job].popleft()
                if not queues[job]:
                    del queues[job]
                bins[slot].append(head)
                tokens[slot] += head.cost
                seqs[slot] += head.seqs
                served[job] += head.cost
        return [b for b in bins if b]


def fits(batch: Sequence[Candidate], tokens: int, c: Candidate, budget: Budget, seqs: int) -> bool:
    """Whether ``c`` may join ``batch``, which holds ``tokens`` KV tokens and ``seqs`` sequences (a
    request with ``n`` > 1 counts ``n`` times against ``max_num_seqs``); an empty batch takes anything."""
    if not batch:
        return True
    return seqs + c.seqs <= budget.max_num_seqs and tokens + c.cost <= budget.kv_tokens


def group_key(c: Candidate) -> tuple:
    """Sort key of the arrangement: priority, first KV block, length bucket, longer prefix."""
    return (-c.priority, c.prefix[:PREFIX_BLOCK_TOKENS], c.cost.bit_length(), c.prefix, c.arrival, c.key)


def arrange(bins: Sequence[Sequence[Candidate]], budget: Budget) -> list[list[Candidate]]:
    """Regroup the selected ``bins``: all their requests sorted by :func:`group_key`, cut next fit.

    When the regrouped cut would need more batches than ``bins`` (fragmentation), the selection's
    own bins are kept, each sorted by :func:`group_key`: nothing selected is ever left out.
    """
    batches: list[list[Candidate]] = []
    tokens = seqs = 0  # the last batch's
    for c in sorted((c for b in bins for c in b), key=group_key):
        if batches and fits(batches[-1], tokens, c, budget, seqs):
            batches[-1].append(c)
            tokens += c.cost
            seqs += c.seqs
        else:
            batches.append([c])
            tokens, seqs = c.cost, c.seqs
    if len(batches) <= len(bins):
        return batches
    return [sorted(b, key=group_key) for b in bins]
