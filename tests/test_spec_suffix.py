"""Suffix decoding (workers/spec/suffix.py): the tree's counts against brute force as sequences come
and go, its drafts on crafted histories, and the proposer's per-sequence trees and group history."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from batchinfer.workers.engine.sequence import Request, Sequence
from batchinfer.workers.sampling_params import SamplingParams
from batchinfer.workers.spec.proposer import Proposer
from batchinfer.workers.spec.suffix import SuffixProposer, SuffixTree


def make_seq(prompt: list[int], seq_id: int, group: str | None = None, lora: str | None = None) -> Sequence:
    req = Request(f"r{seq_id}", None, prompt, SamplingParams(max_tokens=64), arrival_time=0.0,
                  first_seq_id=seq_id)
    req.spec_group = group
    seq = req.seqs[0]
    seq.lora = lora
    return seq


def brute_counts(seqs: list[list[int]], depth: int) -> dict[tuple[int, ...], int]:
    counts: Counter[tuple[int, ...]] = Counter()
    for s in seqs:
        for i in range(len(s)):
            for m in range(1, min(depth, len(s) - i) + 1):
                counts[tuple(s[i:i + m])] += 1
    return dict(counts)


def finish(proposer: SuffixProposer, seq: Sequence, output: list[int]) -> None:
    """Run ``seq`` through the proposer as the engine would: proposed for, output verified, released."""
    proposer.propose([seq], [4])
    for t in output:
        seq.append_token(t)
        proposer.propose([seq], [4])
    proposer.release(seq)


# --- the tree -----------------------------------------------------------------------------------

def test_counts_match_brute_force_as_sequences_come_and_go() -> None:
    rng = random.Random(5)
    for _ in range(200):
        depth = rng.randint(1, 6)
        tree = SuffixTree(depth)
        held: dict[int, list[int]] = {}
        for key in range(8):
            if held and rng.random() < 0.4:
                gone = min(held)  # oldest first, as the proposer removes them
                assert tree.remove(gone)
                del held[gone]
            seq = [rng.randrange(3) for _ in range(rng.randint(0, 12))]
            tree.insert(key, seq)
            held[key] = seq
            assert tree.substring_counts() == brute_counts(list(held.values()), depth)
            assert tree.num_nodes == tree.count_nodes()
            assert tree.num_tokens == sum(map(len, held.values()))


def test_remove_returns_the_tree_to_its_earlier_size() -> None:
    tree = SuffixTree(8)
    tree.insert("a", [1, 2, 3, 1, 2, 4, 1, 2, 3])
    counts, nodes = tree.substring_counts(), tree.num_nodes
    tree.insert("b", [1, 2, 3, 1, 2, 5, 6, 7, 1, 2])
    assert tree.num_nodes > nodes
    assert tree.substring_counts()[(1, 2)] == 3 + 3
    assert tree.remove("b")
    assert tree.substring_counts() == counts and tree.num_nodes == nodes == tree.count_nodes()
    assert not tree.remove("b")  # gone already
    assert tree.remove("a")
    assert tree.num_nodes == 0 and tree.num_tokens == 0 and tree.substring_counts() == {}


def test_unique_text_takes_about_one_node_per_token() -> None:
    tree = SuffixTree(24)
    tree.extend(range(1000, 3000))  # no token repeats
    assert tree.num_nodes == 2000  # one leaf per start, however deep (the bound is tokens x depth)
    history = SuffixTree(24)
    for key in range(50):  # the same output fifty times shares its nodes
        history.insert(key, list(range(100, 400)))
    assert history.num_nodes <= 2 * 300


def test_extending_in_pieces_counts_like_brute_force() -> None:
    rng = random.Random(9)
    for _ in range(200):
        depth = rng.randint(1, 6)
        tree = SuffixTree(depth)
        grown: list[int] = []
        for _ in range(6):
            piece = [rng.randrange(3) for _ in range(rng.randint(0, 5))]
            tree.extend(piece)
            grown += piece
            assert tree.substring_counts() == brute_counts([grown], depth)
            assert tree.num_nodes == tree.count_nodes()


def test_a_tree_grows_one_sequence_or_holds_whole_ones() -> None:
    grows = SuffixTree(4)
    grows.extend([1, 2])
    with pytest.raises(ValueError, match="grows"):
        grows.insert(0, [3])
    holds = SuffixTree(4)
    holds.insert(0, [3])
    with pytest.raises(ValueError, match="whole"):
        holds.extend([1])
    with pytest.raises(ValueError, match="already"):
        holds.insert(0, [4])


def test_the_growing_sequence_drafts_what_followed_its_suffix_before() -> None:
    tree = SuffixTree(8)
    tree.extend([5, 6, 7, 8, 1, 5, 6])
    found = tree.match_growing()
    assert found is not None and found.length == 2 and found.self_counted
    # the one earlier [5, 6] went on with 7, 8, 1, 5, 6: certain, so each adds 1 to the score
    assert tree.speculate(found, 8, 0.1, 4.0) == ([7, 8, 1, 5, 6], 5.0)
    assert tree.speculate(found, 8, 0.1, 1.0) == ([7, 8], 2.0)  # ceil(2 * 1.0) tokens
    assert tree.speculate(found, 1, 0.1, 4.0) == ([7], 1.0)
    fresh = SuffixTree(8)
    fresh.extend([1, 2, 3])
    assert fresh.match_growing() is None


def test_the_most_frequent_child_wins_and_ties_go_to_the_smaller_token() -> None:
    tree = SuffixTree(8)
    for key, out in enumerate([[1, 2, 3], [1, 2, 3], [1, 2, 4]]):
        tree.insert(key, out)
    found = tree.match([9, 1, 2])
    assert found is not None and found.length == 2 and not found.self_counted
    drafts, score = tree.speculate(found, 4, 0.1, 2.0)
    assert drafts == [3] and score == pytest.approx(2 / 3)  # [1, 2, 3] ends there: nothing follows
    tie = SuffixTree(8)
    tie.insert(0, [1, 2, 4, 7])
    tie.insert(1, [1, 2, 3, 7])
    found = tie.match([1, 2])
    assert found is not None
    assert tie.speculate(found, 4, 0.1, 2.0) == ([3, 7], 1.0)  # 0.5 + 0.5
    assert tie.match([8, 8]) is None


def test_min_token_prob_stops_an_uncertain_walk() -> None:
    tree = SuffixTree(8)
    for key, out in enumerate([[1, 2, 3], [1, 2, 4], [1, 2, 5]]):
        tree.insert(key, out)
    found = tree.match([1, 2])
    assert found is not None
    assert tree.speculate(found, 4, 0.5, 2.0) == ([], 0.0)
    drafts, score = tree.speculate(found, 4, 0.3, 2.0)
    assert drafts == [3] and score == pytest.approx(1 / 3)


def test_match_finds_the_longest_suffix_with_a_continuation() -> None:
    tree = SuffixTree(5)
    tree.insert(0, [1, 2, 3, 4, 5, 6])
    tree.insert(1, [9, 3, 4, 7])
    found = tree.match([0, 2, 3, 4])
    assert found is not None and found.length == 3  # [2, 3, 4] (then 5) beats [3, 4]
    # [2, 3, 4] then 5, 6: the stored paths stop at depth 5, however much more was seen
    assert tree.speculate(found, 8, 0.1, 4.0) == ([5, 6], 2.0)
    found = tree.match([8, 3, 4])
    assert found is not None and found.length == 2
    assert tree.speculate(found, 5, 0.1, 1.0) == ([5, 6], 1.0)  # 5 or 7 at 1/2 each; then 6 surely
    assert tree.match([1, 2, 3, 4, 5, 6]) is None  # the stored run ends there


# --- the proposer -------------------------------------------------------------------------------

def test_a_sequence_drafts_from_its_own_prompt_and_output() -> None:
    proposer = SuffixProposer(max_depth=8, max_cached_requests=10, min_token_prob=0.1, max_spec_factor=2.0)
    assert isinstance(proposer, Proposer) and proposer.method == "suffix"
    seq = make_seq([40, 41, 42, 43, 44, 45], seq_id=1)
    assert proposer.propose([seq], [4]) == [[]]
    seq.append_token(41)
    seq.append_token(42)  # [41, 42] was followed by 43, 44 ... in the prompt
    assert proposer.propose([seq], [4]) == [[43, 44, 45, 41]]
    assert proposer.propose([seq], [2]) == [[43, 44]]


def test_the_group_history_helps_the_next_request_of_the_group_only() -> None:
    proposer = SuffixProposer(max_depth=16, max_cached_requests=10, min_token_prob=0.1, max_spec_factor=1.0)
    finish(proposer, make_seq([100, 101], seq_id=1, group="job1"), [1, 2, 3, 4, 5, 6, 7, 8])
    assert proposer.num_cached_outputs == 1
    same = make_seq([200, 1, 2, 3], seq_id=2, group="job1")
    other = make_seq([200, 1, 2, 3], seq_id=3, group="job2")
    adapter = make_seq([200, 1, 2, 3], seq_id=4, group="job1", lora="sql")
    # [1, 2, 3] matched: ceil(3 * 1.0) drafts from job1's history; nothing for the others
    assert proposer.propose([same, other, adapter], [8, 8, 8]) == [[4, 5, 6], [], []]
    assert proposer.history(("job1", None)) is not None
    assert proposer.history(("job2", None)) is None


def test_ungrouped_requests_share_one_history() -> None:
    proposer = SuffixProposer(max_depth=16, max_cached_requests=10, min_token_prob=0.1, max_spec_factor=1.0)
    finish(proposer, make_seq([100], seq_id=1), [7, 8, 9, 10, 11])
    later = make_seq([300, 7, 8], seq_id=2)
    assert proposer.propose([later], [8]) == [[9, 10]]
    assert proposer.history((None, None)) is not None


def test_the_better_scoring_of_own_tree_and_history_wins() -> None:
    proposer = SuffixProposer(max_depth=16, max_cached_requests=10, min_token_prob=0.1, max_spec_factor=4.0)
    finish(proposer, make_seq([100], seq_id=1, group="g"), [1, 2, 50, 51, 52, 53, 54])
    # the history drafts 50..54 after [1, 2], surely: score 5
    # its own prompt says [1, 2] -> 60, 61, ... surely, up to the 8 asked for: score 8
    seq = make_seq([1, 2, 60, 61, 62, 63, 64, 9, 1, 2], seq_id=2, group="g")
    assert proposer.propose([seq], [8]) == [[60, 61, 62, 63, 64, 9, 1, 2]]
    # here its own text saw [1, 2] go on two ways: 1/2 each, 6 tokens to the end: score 3
    seq2 = make_seq([1, 2, 70, 1, 2, 71, 1, 2], seq_id=3, group="g")
    assert proposer.propose([seq2], [8]) == [[50, 51, 52, 53, 54]]


def test_the_history_is_bounded_oldest_first() -> None:
    proposer = SuffixProposer(max_depth=8, max_cached_requests=2, min_token_prob=0.1, max_spec_factor=2.0)
    outputs = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]]
    for i, out in enumerate(outputs):
        finish(proposer, make_seq([100 + i], seq_id=i, group="g"), out)
    assert proposer.num_cached_outputs == 2
    tree = proposer.history(("g", None))
    assert tree is not None
    reference = SuffixTree(8)
    reference.insert(0, outputs[1])
    reference.insert(1, outputs[2])
    assert tree.substring_counts() == reference.substring_counts()
    assert tree.num_nodes == reference.num_nodes
    first = make_seq([1, 2], seq_id=10, group="g")  # only the dropped output knew what follows
    kept = make_seq([5, 6], seq_id=11, group="g")
    assert proposer.propose([first, kept], [4, 4]) == [[], [7, 8]]


def test_the_history_bound_spans_groups_and_drops_the_least_recent_group() -> None:
    proposer = SuffixProposer(max_depth=8, max_cached_requests=3, min_token_prob=0.1, max_spec_factor=2.0,
                              max_groups=2)
    finish(proposer, make_seq([100], seq_id=1, group="a"), [1, 2, 3])
    finish(proposer, make_seq([100], seq_id=2, group="b"), [4, 5, 6])
    finish(proposer, make_seq([100], seq_id=3, group="c"), [7, 8, 9])  # a is the least recently used
    assert proposer.history(("a", None)) is None
    assert proposer.history(("b", None)) is not None and proposer.history(("c", None)) is not None
    finish(proposer, make_seq([100], seq_id=4, group="c"), [10, 11, 12])
    finish(proposer, make_seq([100], seq_id=5, group="c"), [13, 14, 15])  # 4 > 3: b's goes first
    assert proposer.num_cached_outputs == 3
    assert proposer.history(("b", None)) is None


def test_no_history_when_max_cached_requests_is_zero() -> None:
    proposer = SuffixProposer(max_depth=8, max_cached_requests=0, min_token_prob=0.1, max_spec_factor=2.0)
    finish(proposer, make_seq([100], seq_id=1), [1, 2, 3, 4])
    assert proposer.num_cached_outputs == 0 and proposer.history((None, None)) is None
    assert proposer.propose([make_seq([1, 2], seq_id=2)], [4]) == [[]]


def test_release_of_a_sequence_never_proposed_for_files_nothing() -> None:
    proposer = SuffixProposer(max_depth=8)
    seq = make_seq([1, 2], seq_id=1)
    seq.append_token(3)
    proposer.release(seq)
    assert proposer.num_cached_outputs == 0
    proposer.propose([seq], [2])
    proposer.release(seq)
    proposer.release(seq)  # the second release is a no-op too
    assert proposer.num_cached_outputs == 1


def test_drafts_are_deterministic() -> None:
    rng = random.Random(2)
    streams = [[rng.randrange(5) for _ in range(60)] for _ in range(6)]

    def run() -> list[list[int]]:
        proposer = SuffixProposer(max_depth=6, max_cached_requests=3, min_token_prob=0.1, max_spec_factor=2.0)
        drafts = []
        for i, stream in enumerate(streams):
            seq = make_seq(stream[:10], seq_id=i, group="g")
            for t in stream[10:]:
                drafts += proposer.propose([seq], [4])
                seq.append_token(t)
            proposer.release(seq)
        return drafts

    first = run()
    assert any(first) and first == run()


def test_invalid_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="max_depth"):
        SuffixProposer(max_depth=1)
    with pytest.raises(ValueError, match="history"):
        SuffixProposer(max_cached_requests=-1)
