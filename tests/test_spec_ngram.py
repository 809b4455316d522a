"""Prompt-lookup drafts (workers/spec/ngram.py): the pure lookup on crafted sequences, and the
proposer over real engine sequences, whose cached arrays must always agree with the pure lookup."""

from __future__ import annotations

import random

import numpy as np
import pytest

from batchinfer.workers.engine.sequence import Request, Sequence
from batchinfer.workers.sampling_params import SamplingParams
from batchinfer.workers.spec.ngram import NgramProposer, propose_ngram, suffix_match_lengths
from batchinfer.workers.spec.proposer import Proposer


def make_seq(prompt: list[int], seq_id: int = 0) -> Sequence:
    req = Request(f"r{seq_id}", None, prompt, SamplingParams(max_tokens=64), arrival_time=0.0,
                  first_seq_id=seq_id)
    return req.seqs[0]


def test_the_most_recent_occurrence_gives_the_draft() -> None:
    tokens = [1, 2, 3, 4, 9, 1, 2, 3, 5, 7, 1, 2, 3]
    # [1, 2, 3] ended at 2 (then 4) and at 7 (then 5): the later one wins
    assert propose_ngram(tokens, 2, 3, 4) == [5, 7, 1, 2]
    assert propose_ngram(tokens, 2, 3, 1) == [5]  # k caps the draft


def test_a_longer_pattern_wins_over_a_more_recent_shorter_one() -> None:
    tokens = [7, 1, 2, 3, 4, 8, 2, 3, 5, 7, 1, 2, 3]
    # the last 4 tokens [7, 1, 2, 3] occur at the start (then 4, 8); only [2, 3] occurs later (then 5)
    assert propose_ngram(tokens, 2, 4, 3) == [4, 8, 2]
    assert propose_ngram(tokens, 2, 2, 3) == [5, 7, 1]
    assert propose_ngram(tokens, 2, 3, 3) == [4, 8, 2]  # [1, 2, 3] occurs only at the start too


def test_min_n_and_no_match_give_no_draft() -> None:
    tokens = [1, 2, 3, 9, 3]
    assert propose_ngram(tokens, 2, 4, 3) == []  # [9, 3] never occurred before
    assert propose_ngram(tokens, 1, 4, 3) == [9, 3]  # a single token may match when min_n is 1
    assert propose_ngram([5, 6, 7, 8], 1, 3, 4) == []
    assert propose_ngram([], 1, 3, 4) == []
    assert propose_ngram([4], 1, 3, 4) == []
    assert propose_ngram([4, 4], 1, 3, 0) == []  # k = 0


def test_the_draft_stops_at_the_end_of_the_sequence() -> None:
    # [1, 2] ends at 1; only [1, 2] follows before the sequence ends (the overlap is fine)
    assert propose_ngram([1, 2, 1, 2], 2, 2, 5) == [1, 2]
    assert propose_ngram([3, 3, 3], 1, 4, 5) == [3]  # the longest earlier occurrence is [3, 3]


def test_suffix_match_lengths_counts_trailing_agreement() -> None:
    hay = np.array([5, 1, 2, 9, 2, 1, 2])
    ends, lengths = suffix_match_lengths(hay, np.array([0, 1, 2]), 5)
    assert ends.tolist() == [2, 4, 6]
    assert lengths.tolist() == [2, 1, 2]
    ends, lengths = suffix_match_lengths(hay, np.array([7]), 5)
    assert ends.tolist() == [] and lengths.tolist() == []


def test_drafts_are_deterministic_and_match_a_brute_force_lookup() -> None:
    rng = random.Random(3)
    for _ in range(300):
        tokens = [rng.randrange(4) for _ in range(rng.randint(0, 30))]
        min_n = rng.randint(1, 3)
        max_n = rng.randint(min_n, 5)
        k = rng.randint(1, 5)
        expected: list[int] = []
        for n in range(max_n, min_n - 1, -1):
            if n >= len(tokens):
                continue
            pattern = tokens[-n:]
            hits = [j for j in range(n - 1, len(tokens) - 1) if tokens[j - n + 1:j + 1] == pattern]
            if hits:  # the most recent hit that k tokens follow, else the earliest
                whole = [j for j in hits if j + k <= len(tokens) - 1]
                j = whole[-1] if whole else hits[0]
                expected = tokens[j + 1:j + 1 + k]
                break
        assert propose_ngram(tokens, min_n, max_n, k) == expected, (tokens, min_n, max_n, k)
        assert propose_ngram(tokens, min_n, max_n, k) == propose_ngram(list(tokens), min_n, max_n, k)


def test_the_proposer_follows_the_growing_sequence() -> None:
    rng = random.Random(7)
    prompt = [rng.randrange(6) for _ in range(40)]
    seq = make_seq(prompt)
    proposer = NgramProposer(2, 4)
    assert isinstance(proposer, Proposer) and proposer.method == "ngram"
    for step in range(400):  # past the first buffer's 256 tokens, so its growth is covered
        drafts = proposer.propose([seq], [3])
        assert drafts == [propose_ngram(seq.token_ids, 2, 4, 3)], step
        for _ in range(rng.randint(1, 3)):  # a verify step may accept several tokens at once
            seq.append_token(rng.randrange(6))


def test_the_proposer_drafts_for_several_sequences_with_their_own_limits() -> None:
    a = make_seq([10, 11, 12, 13, 10, 11], seq_id=1)
    b = make_seq([20, 21, 22, 20, 21], seq_id=2)
    c = make_seq([30, 31, 32], seq_id=3)
    proposer = NgramProposer(2, 3)
    assert proposer.propose([a, b, c], [4, 1, 4]) == [[12, 13, 10, 11], [22], []]
    a.append_token(12)  # [10, 11, 12] now ends the sequence and ended at 2 before
    assert proposer.propose([a], [4]) == [[13, 10, 11, 12]]
    proposer.release(a)
    proposer.release(a)  # a second release, and one for a sequence never seen, are no-ops
    proposer.release(make_seq([1], seq_id=9))
    assert proposer.propose([a], [2]) == [[13, 10]]  # rebuilt from scratch after the release


def test_a_4000_token_sequence_drafts_from_a_planted_repeat() -> None:
    rng = random.Random(11)
    tokens = [rng.randrange(1000, 30000) for _ in range(4000)]
    tokens[1000:1006] = [1, 2, 3, 4, 5, 6]  # a pattern and what followed it long ago
    tokens[-3:] = [1, 2, 3]
    assert propose_ngram(tokens, 2, 5, 3) == [4, 5, 6]
    seq = make_seq(tokens[:3990])
    proposer = NgramProposer(2, 5)
    proposer.propose([seq], [3])
    for t in tokens[3990:]:
        seq.append_token(t)
    assert proposer.propose([seq], [3]) == [[4, 5, 6]]


def test_invalid_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match="min_n"):
        NgramProposer(3, 2)
    with pytest.raises(ValueError, match="min_n"):
        NgramProposer(0, 2)
