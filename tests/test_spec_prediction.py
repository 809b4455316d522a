"""Drafts from a predicted output (workers/spec/prediction.py): the cursor follows verified tokens,
and after the output departs from the prediction it re-synchronises on the output's last tokens."""

from __future__ import annotations

import numpy as np

from batchinfer.workers.engine.sequence import Request, Sequence
from batchinfer.workers.sampling_params import SamplingParams
from batchinfer.workers.spec.prediction import PredictionProposer, resync_position
from batchinfer.workers.spec.proposer import Proposer


def make_seq(prediction: list[int] | None, seq_id: int = 0, prompt: list[int] | None = None) -> Sequence:
    req = Request(f"r{seq_id}", None, prompt or [900, 901], SamplingParams(max_tokens=64), arrival_time=0.0,
                  first_seq_id=seq_id)
    req.prediction_token_ids = prediction
    return req.seqs[0]


def emit(seq: Sequence, tokens: list[int]) -> None:
    for t in tokens:
        seq.append_token(t)


def test_before_any_output_the_prediction_opens_the_draft() -> None:
    proposer = PredictionProposer()
    assert isinstance(proposer, Proposer) and proposer.method == "prediction"
    seq = make_seq([10, 11, 12, 13, 14])
    assert proposer.propose([seq], [3]) == [[10, 11, 12]]
    assert proposer.propose([seq], [9]) == [[10, 11, 12, 13, 14]]


def test_the_cursor_follows_accepted_tokens() -> None:
    prediction = list(range(10, 30))
    seq = make_seq(prediction)
    proposer = PredictionProposer()
    assert proposer.propose([seq], [4]) == [[10, 11, 12, 13]]
    emit(seq, [10, 11, 12])  # one verify step accepted three tokens
    assert proposer.propose([seq], [4]) == [[13, 14, 15, 16]]
    emit(seq, [13])
    assert proposer.propose([seq], [2]) == [[14, 15]]
    emit(seq, prediction[4:])  # the whole prediction was written: nothing left to draft
    assert proposer.propose([seq], [4]) == [[]]


def test_after_a_divergence_it_waits_then_resynchronises() -> None:
    prediction = list(range(10, 30))
    seq = make_seq(prediction)
    proposer = PredictionProposer()
    emit(seq, [10, 11, 12, 99])  # 99 is nowhere in the prediction
    assert proposer.propose([seq], [4]) == [[]]
    emit(seq, [13])  # back on track: 13 is at 3, so 14 comes next
    assert proposer.propose([seq], [4]) == [[14, 15, 16, 17]]
    emit(seq, [14, 15])  # and the cursor follows again
    assert proposer.propose([seq], [2]) == [[16, 17]]


def test_a_skip_ahead_is_found_on_the_longest_tail() -> None:
    prediction = list(range(10, 30))
    seq = make_seq(prediction)
    proposer = PredictionProposer()
    emit(seq, [10, 11, 12, 20, 21])  # 13..19 skipped
    assert proposer.propose([seq], [3]) == [[22, 23, 24]]


def test_a_longer_match_beats_a_single_token_one() -> None:
    prediction = [1, 2, 3, 9, 4, 3, 5]
    seq = make_seq(prediction)
    proposer = PredictionProposer()
    emit(seq, [1, 2, 0, 4, 3])  # departs at 0; [4, 3] sits at 4..5, a lone 3 also at 2
    assert proposer.propose([seq], [4]) == [[5]]


def test_positions_at_or_after_the_departure_are_preferred() -> None:
    prediction = [7, 8, 9, 7, 8, 6, 7, 8, 5]
    seq = make_seq(prediction)
    proposer = PredictionProposer()
    emit(seq, [7, 8, 9, 0, 7, 8])  # departs where 7 (index 3) was due; [7, 8] is at 0, 3 and 6
    assert proposer.propose([seq], [4]) == [[6, 7, 8, 5]]
    # when the output repeats what came before the departure, the latest earlier place is used
    seq = make_seq([1, 2, 3, 4, 5, 6], seq_id=1)
    emit(seq, [1, 2, 3, 4, 5, 2, 3])
    assert proposer.propose([seq], [4]) == [[4, 5, 6]]


def test_resync_position_directly() -> None:
    prediction = np.array([5, 1, 2, 5, 1, 2, 8])
    assert resync_position(prediction, [1, 2], 0) == 3
    assert resync_position(prediction, [1, 2], 4) == 6
    assert resync_position(prediction, [1, 2], 7) == 6  # nothing at or after: the last before
    assert resync_position(prediction, [4], 0) is None
    assert resync_position(prediction, [], 0) is None


def test_no_prediction_no_drafts() -> None:
    proposer = PredictionProposer()
    assert proposer.propose([make_seq(None), make_seq([], seq_id=1)], [4, 4]) == [[], []]
    seq = make_seq([1, 2, 3], seq_id=2)
    assert proposer.propose([seq], [0]) == [[]]


def test_several_sequences_release_and_determinism() -> None:
    a = make_seq([1, 2, 3, 4], seq_id=1)
    b = make_seq([5, 6, 7, 8], seq_id=2)
    proposer = PredictionProposer()
    emit(a, [1, 2])
    emit(b, [5, 0])
    assert proposer.propose([a, b], [2, 2]) == [[3, 4], []]
    proposer.release(b)
    proposer.release(b)  # again, and for a sequence never proposed for: no-ops
    proposer.release(make_seq([1], seq_id=3))
    assert len(proposer._cursors) == 1
    emit(a, [3])
    fresh = PredictionProposer()  # a proposer that never saw a's history drafts the same
    assert proposer.propose([a], [2]) == fresh.propose([a], [2]) == [[4]]
