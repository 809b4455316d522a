"""Drafts from a request's predicted output (OpenAI "predicted outputs"): the text the caller expects
the model to write, e.g. the file being edited. While the output follows the prediction, the next
predicted tokens are the draft; after the output departs from it, its last few tokens are looked up
in the prediction to find where it rejoined, and drafting resumes from there."""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf
from typing import TYPE_CHECKING

import numpy as np

from batchinfer.workers.spec.ngram import suffix_match_lengths

if TYPE_CHECKING:
    from batchinfer.workers.engine.sequence import Sequence

# Re-synchronising looks up at most this many trailing output tokens (the longest match wins; a
# single token only when nothing longer occurs in the prediction).
RESYNC_MAX_TOKENS = 8


class _Cursor:
    """Where one sequence stands in its prediction."""

    __slots__ = ("prediction", "array", "position", "seen", "in_sync")

    def __init__(self, prediction: list[int]) -> None:
        self.prediction = prediction
        self.array = np.asarray(prediction, dtype=np.int64)  # [P], for re-synchronising
        # the prediction index where the next output token is expected (while out of sync: where
        # it was expected when the output departed, the anchor of the search for a rejoin)
        self.position = 0
        self.seen = 0  # output tokens accounted for
        self.in_sync = True


def resync_position(prediction: np.ndarray, output: SequenceOf[int], anchor: int) -> int | None:
    """The prediction index that follows the output's last tokens, or None when none of them occur.

    The longest trailing run of the output (up to ``RESYNC_MAX_TOKENS``) found in the prediction
    wins; among its occurrences the first that resumes at or after ``anchor`` (the output departed
    there, so it most likely rejoined later), else the last one before it."""
    max_len = min(RESYNC_MAX_TOKENS, len(output), prediction.size)
    if max_len < 1:
        return None
    tail = np.asarray(output[-max_len:], dtype=np.int64)  # [m]
    ends, lengths = suffix_match_lengths(prediction, tail, max_len)
    if ends.size == 0:
        return None
    resumes = ends[lengths == lengths.max()] + 1  # ascending
    later = resumes[resumes >= anchor]
    return int(later[0]) if later.size else int(resumes[-1])


class PredictionProposer:
    """The ``prediction`` method: drafts from ``seq.request.prediction_token_ids`` (none: no drafts)."""

    method = "prediction"

    def __init__(self) -> None:
        self._cursors: dict[int, _Cursor] = {}  # seq_id -> its place in the prediction

    def propose(self, seqs: SequenceOf[Sequence], max_tokens: SequenceOf[int]) -> list[list[int]]:
        """Drafts for each of ``seqs``, at most ``max_tokens[i]`` each."""
        return [self._propose_one(seq, k) for seq, k in zip(seqs, max_tokens, strict=True)]

    def _propose_one(self, seq: Sequence, k: int) -> list[int]:
        request = seq.request
        prediction = request.prediction_token_ids if request is not None else None
        if not prediction or k < 1:
            return []
        cur = self._cursors.get(seq.seq_id)
        if cur is None or cur.prediction is not prediction:
            cur = self._cursors[seq.seq_id] = _Cursor(prediction)
        output = seq.output_token_ids
        if cur.in_sync:  # follow the verified tokens while they are the predicted ones
            pos, n_pred = cur.position, len(prediction)
            for token in output[cur.seen:]:
                if pos < n_pred and prediction[pos] == token:
                    pos += 1
                else:
                    cur.in_sync = False
                    break
            cur.position = pos
        cur.seen = len(output)
        if not cur.in_sync:
            rejoin = resync_position(cur.array, output, cur.position)
            if rejoin is None:
                return []  # no alignment yet; retried with the next tokens
            cur.position, cur.in_sync = rejoin, True
        return prediction[cur.position:cur.position + k]

    def release(self, seq: Sequence) -> None:
        """Forget ``seq``'s cursor (a no-op for a sequence never proposed for)."""
        self._cursors.pop(seq.seq_id, None)
