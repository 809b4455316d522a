"""``SpecDecoder``: the engine's side of speculative decoding.

Before each step it asks a proposer for draft tokens for every running sequence that is decoding
(``propose``); the step scheduler runs them after the sequence's owed token and the sampler draws
one token per position (row i: the distribution after the drafts before it). After the step,
:func:`num_accepted` keeps the drafts the target itself sampled, so the output is token for token
what decoding without speculation gives (greedy, seeded and unseeded alike: an unseeded draw is one
of the target's own distribution at each position).

Which proposer: a request's own ``prediction`` first (OpenAI predicted outputs) while it aligns
with the output, then the configured method. A completion constrained by a grammar keeps the
drafts its grammar accepts, up to a state whose text is forced (``cut``: the structured-output
manager's ``cut_drafts``). Off for a request that says ``speculative: false``, and for the whole
step while more sequences run than ``disable_by_batch_size``: a full batch is bound by compute,
where verifying drafts costs more than it saves.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from batchinfer.workers.spec.proposer import Proposer

if TYPE_CHECKING:
    from batchinfer.workers.engine.sequence import Sequence
    from batchinfer.workers.speculative_config import SpeculativeConfig

log = logging.getLogger(__name__)


def num_accepted(drafts: Seq[int], sampled: Seq[int]) -> int:
    """How many of ``drafts`` are kept: the longest prefix where each draft is the token the target
    sampled at that position (``sampled[i]`` is the target's token after ``drafts[:i]``).
    The step then emits ``sampled[:num_accepted + 1]``."""
    a = 0
    while a < len(drafts) and drafts[a] == sampled[a]:
        a += 1
    return a


@dataclass
class MethodStats:
    """Cumulative counters of one method."""

    drafts: int = 0  # sequence-steps that carried drafts
    draft_tokens: int = 0  # draft tokens verified
    accepted_tokens: int = 0  # of them kept


class SpecDecoder:
    """Proposes drafts each step and keeps the acceptance statistics."""

    def __init__(self, config: SpeculativeConfig, proposers: dict[str, Proposer], max_model_len: int) -> None:
        self.config = config
        self.proposers = proposers  # method -> proposer ("prediction" included when predictions are used)
        self.max_model_len = max_model_len
        self.stats: dict[str, MethodStats] = {m: MethodStats() for m in proposers}
        self.num_steps = 0  # steps that verified at least one draft
        self.num_disabled_steps = 0  # steps the batch-size switch turned speculation off
        self._method_of: dict[int, str] = {}  # seq_id -> the method of its drafts this step
        self._seen: dict[int, set[str]] = {}  # seq_id -> the proposers that hold state for it
        # A constrained completion's drafts -> the prefix its grammar allows (set by the engine).
        self.cut: Callable[[Sequence, list[int]], list[int]] | None = None

    @classmethod
    def build(cls, config: SpeculativeConfig, *, max_model_len: int, **draft: Any) -> SpecDecoder:
        """The decoder of ``config``: its method's proposer and, when predictions are used, the
        prediction proposer. ``draft``: what the draft-model proposer needs (``engine_config``,
        ``tokenizer``, ``vocab_size``), read only for method "draft"."""
        proposers: dict[str, Proposer] = {}
        if config.use_predictions:
            from batchinfer.workers.spec.prediction import PredictionProposer

            proposers["prediction"] = PredictionProposer()
        if config.method == "ngram":
            from batchinfer.workers.spec.ngram import NgramProposer

            proposers["ngram"] = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
        elif config.method == "suffix":
            from batchinfer.workers.spec.suffix import SuffixProposer

            proposers["suffix"] = SuffixProposer(config.suffix_max_depth, config.suffix_max_cached_requests,
                                                 config.suffix_min_token_prob, config.suffix_max_spec_factor)
        elif config.method == "draft":
            from batchinfer.workers.spec.draft import DraftModelProposer

            proposers["draft"] = DraftModelProposer.from_config(config, max_model_len=max_model_len, **draft)
        return cls(config, proposers, max_model_len)

    # -- before the step ------------------------------------------------------------------------

    def propose(self, running: Seq[Sequence]) -> None:
        """Set ``spec_token_ids`` of the running sequences that speculate this step."""
        self._method_of.clear()
        limit = self.config.disable_by_batch_size
        if limit is not None and len(running) > limit:
            self.num_disabled_steps += 1
            return
        k = self.config.num_speculative_tokens
        predicted: list[Sequence] = []
        others: list[Sequence] = []
        rooms: dict[int, int] = {}
        for seq in running:
            req = seq.request
            if req is None or seq.num_tokens_owed != 1 or not req.params.speculative:
                continue
            room = min(k, self._room(seq))
            if room < 1:
                continue
            rooms[seq.seq_id] = room
            if req.prediction_token_ids and "prediction" in self.proposers:
                predicted.append(seq)
            else:
                others.append(seq)
        if predicted:
            others += self._propose("prediction", predicted, rooms)  # unaligned ones try the method
        if others and self.config.method is not None:
            self._propose(self.config.method, others, rooms)

    def _room(self, seq: Sequence) -> int:
        """Drafts that can still become output: the step emits up to drafts + 1 tokens, within
        ``max_tokens`` and ``max_model_len`` (a draft's position must be below it)."""
        room = self.max_model_len - seq.num_tokens
        max_tokens = seq.request.params.max_tokens if seq.request is not None else None
        if max_tokens is not None:
            room = min(room, max_tokens - seq.num_output_tokens - 1)
        return room

    def _propose(self, method: str, seqs: list[Sequence], rooms: dict[int, int]) -> list[Sequence]:
        """Ask ``method``'s proposer; returns the sequences it gave no draft."""
        try:
            drafts = self.proposers[method].propose(seqs, [rooms[s.seq_id] for s in seqs])
        except Exception:  # noqa: BLE001 - drafts only ever save time: decode without them
            log.exception("speculative proposer %s failed; this step runs without its drafts", method)
            drafts = [[] for _ in seqs]
        empty = []
        for seq, draft in zip(seqs, drafts, strict=True):
            self._seen.setdefault(seq.seq_id, set()).add(method)
            draft = list(draft[:rooms[seq.seq_id]])
            if draft and seq.matcher is not None and self.cut is not None:
                draft = self.cut(seq, draft)
            if draft:
                seq.spec_token_ids = draft
                self._method_of[seq.seq_id] = method
            else:
                empty.append(seq)
        return empty

    # -- after the step -------------------------------------------------------------------------

    def record(self, seq: Sequence, num_drafts: int, accepted: int) -> None:
        """``seq`` ran ``num_drafts`` drafts this step and kept ``accepted`` of them."""
        seq.num_draft_tokens += num_drafts
        seq.num_accepted_tokens += accepted
        method = self._method_of.get(seq.seq_id, self.config.method or "prediction")
        if method == "prediction":
            seq.num_prediction_drafts += num_drafts
            seq.num_prediction_accepted += accepted
        s = self.stats[method]
        s.drafts += 1
        s.draft_tokens += num_drafts
        s.accepted_tokens += accepted

    def step_verified(self) -> None:
        """A step ran (and verified) at least one draft."""
        self.num_steps += 1

    def release(self, seq: Sequence) -> None:
        """``seq`` finished: the proposers that saw it forget it (the suffix one files its output)."""
        for method in self._seen.pop(seq.seq_id, ()):
            try:
                self.proposers[method].release(seq)
            except Exception:  # noqa: BLE001 - a proposer's bookkeeping must never fail a request
                log.exception("speculative proposer %s failed to release sequence %d", method, seq.seq_id)

    def summary(self) -> dict[str, Any]:
        """The cumulative counters (``Engine.spec_stats``)."""
        return {"methods": {m: {"drafts": s.drafts, "draft_tokens": s.draft_tokens,
                                "accepted_tokens": s.accepted_tokens} for m, s in self.stats.items()},
                "steps": self.num_steps, "disabled_steps": self.num_disabled_steps}
