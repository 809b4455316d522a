"""What every draft-token proposer offers the engine's ``SpecDecoder``.

A proposer guesses the next tokens of running sequences; the target model verifies every guess in
one forward and keeps only what it samples itself, so a proposer can change speed, never output.
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from batchinfer.workers.engine.sequence import Sequence


@runtime_checkable
class Proposer(Protocol):
    """Drafts tokens for running sequences: host-side, fast, bounded in memory and deterministic
    (same inputs, same drafts). Ordinary input never raises: no guess is an empty draft."""

    method: str  # "ngram" | "suffix" | "prediction" | "draft"

    def propose(self, seqs: SequenceOf[Sequence], max_tokens: SequenceOf[int]) -> list[list[int]]:
        """Drafts for each of ``seqs`` (at most ``max_tokens[i]`` each, each >= 1; [] = no draft).
        Called once per step with the sequences that may speculate this step."""
        ...

    def release(self, seq: Sequence) -> None:
        """``seq`` finished or was aborted: forget its state. Called exactly once per sequence ever
        passed to ``propose``, and possibly for sequences never passed (a no-op then)."""
        ...
