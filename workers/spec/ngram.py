"""Prompt-lookup drafts: the tokens that followed the most recent earlier occurrence (that k tokens
follow) of the sequence's last n tokens (n from ``max_n`` down to ``min_n``), found by vectorised
compares over the whole prompt + output. Repetitive text (code edits, quoting the prompt, lists)
drafts well; the cost per step is O(length) numpy work plus O(occurrences of the last token *
max_n)."""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from batchinfer.workers.engine.sequence import Sequence


def suffix_match_lengths(hay: np.ndarray, tail: np.ndarray, max_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Where ``tail``'s trailing tokens occur in ``hay``: the end positions ``q`` (ascending) with
    ``hay[q] == tail[-1]``, and for each how many trailing tokens of ``tail`` match ending at ``q``
    (``hay[q-m+1:q+1] == tail[-m:]``), capped at ``max_len``. Both int64 [C]."""
    if hay.size == 0 or tail.size == 0 or max_len < 1:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty
    ends = np.flatnonzero(hay == tail[-1])  # [C]
    lengths = np.ones(ends.shape, dtype=np.int64)  # [C]
    alive = np.arange(ends.size)  # candidates still matching: indices into ends
    for s in range(1, min(max_len, tail.size)):
        alive = alive[ends[alive] >= s]  # the occurrence may not start before hay does
        alive = alive[hay[ends[alive] - s] == tail[-1 - s]]
        if alive.size == 0:
            break
        lengths[alive] += 1
    return ends, lengths


def propose_ngram(tokens: SequenceOf[int] | np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    """Prompt lookup: for n from ``max_n`` down to ``min_n``, the last n tokens of ``tokens`` are the
    pattern; at its most recent earlier occurrence that ``k`` tokens follow (else its earliest one),
    return up to ``k`` of the tokens that followed it. [] when no n matches (or ``k`` < 1)."""
    arr = np.asarray(tokens, dtype=np.int64)  # [L]
    length = arr.size
    min_n = max(min_n, 1)
    if k < 1 or max_n < min_n or length < min_n + 1:
        return []
    # candidate ends j <= L - 2, so at least one token follows the occurrence
    ends, lengths = suffix_match_lengths(arr[:-1], arr, max_n)
    if ends.size == 0:
        return []
    best = int(lengths.max())
    if best < min_n:
        return []
    n = min(best, max_n)  # the longest pattern size that matches anywhere
    found = ends[np.flatnonzero(lengths >= n)]  # [M] its occurrences, ascending
    # the most recent one that k tokens follow; else the earliest (the most follow it): in a run of
    # one repeated token the most recent occurrence is the one just before the end, followed by one
    whole = found[found <= length - 1 - k]
    j = int(whole[-1]) if whole.size else int(found[0])
    return arr[j + 1:j + 1 + k].tolist()


class _TokenBuffer:
    """A sequence's prompt + output as a growing int64 array, so each step converts only new tokens."""

    __slots__ = ("data", "size")

    def __init__(self) -> None:
        self.data = np.zeros(256, dtype=np.int64)
        self.size = 0

    def sync(self, token_ids: list[int]) -> np.ndarray:
        """Append what ``token_ids`` gained since the last call; return the filled view [L]."""
        if len(token_ids) < self.size:  # token_ids never shrink; rebuild rather than trust a stale copy
            self.size = 0
        new = token_ids[self.size:]
        if new:
            need = self.size + len(new)
            if need > self.data.size:
                grown = np.zeros(max(need, 2 * self.data.size), dtype=np.int64)
                grown[:self.size] = self.data[:self.size]
                self.data = grown
            self.data[self.size:need] = new
            self.size = need
        return self.data[:self.size]


class NgramProposer:
    """The ``ngram`` method: prompt lookup over each sequence's prompt + verified output."""

    method = "ngram"

    def __init__(self, min_n: int, max_n: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"ngram sizes need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.min_n = min_n
        self.max_n = max_n
        self._buffers: dict[int, _TokenBuffer] = {}  # seq_id -> its tokens as numpy

    def propose(self, seqs: SequenceOf[Sequence], max_tokens: SequenceOf[int]) -> list[list[int]]:
        """Drafts for each of ``seqs``, at most ``max_tokens[i]`` each."""
        drafts: list[list[int]] = []
        for seq, k in zip(seqs, max_tokens, strict=True):
            buf = self._buffers.get(seq.seq_id)
            if buf is None:
                buf = self._buffers[seq.seq_id] = _TokenBuffer()
            drafts.append(propose_ngram(buf.sync(seq.token_ids), self.min_n, self.max_n, k))
        return drafts

    def release(self, seq: Sequence) -> None:
        """Drop ``seq``'s cached array (a no-op for a sequence never proposed for)."""
        self._buffers.pop(seq.seq_id, None)
