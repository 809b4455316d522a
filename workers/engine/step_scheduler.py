"""The step scheduler: which sequences run how many tokens in the next forward pass.

Policy (vLLM v1's "tokens owed"): each step hands out at most ``max_num_batched_tokens`` tokens
over at most ``max_num_seqs`` running sequences. Running sequences go first, oldest first, each
getting what it owes (one token when decoding, a chunk when still prefilling). Then waiting
sequences are admitted in arrival order, their prompts chunked to the budget left, so prefill
chunks and decodes share one forward. When a running sequence needs a block and none is free,
the newest running sequence is preempted: its blocks are freed and it goes back to the front of
the queue owing all of its tokens (recompute). Nothing is ever dropped.

An optional admission ``gate`` (the LoRA manager) may hold a waiting sequence back (its adapter
is not loaded yet, or no adapter slot is free): it stays in the queue, in order, and the
sequences behind it are still admitted. The gate hears of every admission and every running
sequence that stops running (preempted or finished).
"""

from __future__ import annotations

import bisect
import contextlib
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from batchinfer.workers.engine.block_manager import BlockManager
from batchinfer.workers.engine.sequence import Sequence, SequenceStatus

if TYPE_CHECKING:
    from batchinfer.workers.engine_config import StepSchedulerConfig


@dataclass
class ScheduledSequence:
    """``seq`` runs its tokens ``[start, start + num_new_tokens)`` this step.

    ``samples``: the step reaches the sequence's last token, so a new one is sampled from it.
    ``spec_token_ids``: draft tokens run after it (speculative decoding); they are the last
    ``len(spec_token_ids)`` of ``num_new_tokens`` and count in the step's budget, but are not the
    sequence's tokens until verified.
    """

    seq: Sequence
    start: int
    num_new_tokens: int
    samples: bool
    spec_token_ids: list[int] = field(default_factory=list)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    num_batched_tokens: int = 0

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class AdmissionGate(Protocol):
    """Decides which waiting sequences may start running (``workers.lora.manager.LoRAManager``)."""

    def can_admit(self, seq: Sequence) -> bool: ...

    def admitted(self, seq: Sequence) -> None: ...

    def released(self, seq: Sequence) -> None: ...


class StepScheduler:
    """Keeps the waiting queue and the running set; ``schedule()`` plans one step."""

    def __init__(self, block_manager: BlockManager, max_num_batched_tokens: int, max_num_seqs: int,
                 gate: AdmissionGate | None = None) -> None:
        self.block_manager = block_manager
        self.gate = gate
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # sorted by sort_key: oldest first
        self.num_preemptions = 0
        # Told of every sequence that finishes (the speculative decoder forgets its state then).
        self.on_finish: Callable[[Sequence], None] | None = None

    @classmethod
    def from_config(cls, block_manager: BlockManager, config: StepSchedulerConfig,
                    gate: AdmissionGate | None = None) -> StepScheduler:
        """A scheduler with the engine's step budget (its scheduler part)."""
        return cls(block_manager, config.max_num_batched_tokens, config.max_num_seqs, gate)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def schedule(self) -> SchedulerOutput:
        """Plan the next step. Blocks are allocated here; ``commit`` records the step as done."""
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        bm, running = self.block_manager, self.running
        i = 0
        while i < len(running) and budget > 0:
            seq = running[i]
            n = min(seq.num_tokens_owed, budget)
            drafts = self._drafts(seq, n, budget)
            while not bm.allocate(seq, n, num_lookahead_tokens=len(drafts)):
                if drafts:  # no room for the drafts: decode without them before preempting anyone
                    drafts = []
                    continue
                victim = running.pop()  # the newest; never one already scheduled (they are < i)
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            else:
                start = seq.num_computed_tokens
                out.scheduled.append(ScheduledSequence(seq, start, n + len(drafts),
                                                       start + n == seq.num_tokens, drafts))
                budget -= n + len(drafts)
                i += 1
        # Admitting new work while preempting would only thrash.
        gate = self.gate
        held: list[Sequence] = []  # waiting sequences the gate holds back this step
        while self.waiting and not out.preempted and budget > 0 and len(running) < self.max_num_seqs:
            seq = self.waiting[0]
            if gate is not None and not gate.can_admit(seq):
                held.append(self.waiting.popleft())  # put back in order below
                continue
            cached = bm.find_cached_prefix(seq)
            hit = len(cached) * bm.block_size
            n = min(seq.num_tokens - hit, budget)
            if not bm.allocate(seq, n, cached):
                break
            self.waiting.popleft()
            seq.num_computed_tokens = hit
            if seq.num_cached_tokens is None:
                seq.num_cached_tokens = hit
            seq.status = SequenceStatus.RUNNING
            bisect.insort(running, seq, key=lambda s: s.sort_key)
            if gate is not None:
                gate.admitted(seq)
            out.scheduled.append(ScheduledSequence(seq, hit, n, hit + n == seq.num_tokens))
            budget -= n
        if held:
            self.waiting.extendleft(reversed(held))
        out.num_batched_tokens = self.max_num_batched_tokens - budget
        return out

    @staticmethod
    def _drafts(seq: Sequence, n: int, budget: int) -> list[int]:
        """The draft tokens ``seq`` runs after its ``n`` owed tokens: its proposal when it is
        decoding (owes one token), cut to the budget left."""
        drafts = seq.spec_token_ids
        if not drafts:
            return drafts
        seq.spec_token_ids = []  # a proposal is for one step only
        if n != 1 or seq.num_tokens_owed != 1:
            return []
        return drafts[:budget - 1]

    def commit(self, out: SchedulerOutput) -> None:
        """The step ran: its tokens are now in the KV cache (drafts only once verified:
        ``accept_drafts``)."""
        for s in out.scheduled:
            s.seq.num_computed_tokens = s.start + s.num_new_tokens - len(s.spec_token_ids)

    def accept_drafts(self, seq: Sequence, num_accepted: int) -> None:
        """``num_accepted`` of the drafts ``seq`` ran this step were verified (and appended to its
        tokens): their K/V count as computed; the blocks that only rejected drafts used are freed."""
        if seq.status is not SequenceStatus.RUNNING:  # it finished on one of them: blocks already freed
            return
        seq.num_computed_tokens += num_accepted
        self.block_manager.trim(seq, seq.num_computed_tokens)

    def finish(self, seq: Sequence) -> None:
        """Remove a finished or aborted sequence and free its blocks (idempotent)."""
        if seq.status is not SequenceStatus.FINISHED and self.on_finish is not None:
            self.on_finish(seq)
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            if self.gate is not None:
                self.gate.released(seq)
        elif seq.status is SequenceStatus.WAITING:
            with contextlib.suppress(ValueError):  # created but never added
                self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED

    def _preempt(self, seq: Sequence) -> None:
        seq.spec_token_ids = []
        if self.gate is not None:
            self.gate.released(seq)
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
