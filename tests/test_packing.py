"""Packing policy: budgets, exactly-once packing, priority, fair share, prefix grouping (pure)."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchinfer.scheduler.packing import Budget, Candidate, Packer


def cand(key, job="j", priority=0, prompt=10, max_tokens=10, arrival=0, prefix=(), seqs=1):
    return Candidate(key=str(key), job=job, priority=priority, prompt_tokens=prompt, max_tokens=max_tokens,
                     arrival=arrival, prefix=tuple(prefix), seqs=seqs)


candidates = st.lists(
    st.builds(
        lambda job, pri, prompt, mt, arrival, pfx, seqs: (job, pri, prompt, mt, arrival, pfx, seqs),
        st.sampled_from(["a", "b", "c", "d"]), st.integers(-1, 2), st.integers(1, 300), st.integers(0, 200),
        st.integers(0, 50), st.lists(st.integers(0, 3), max_size=20),
        st.sampled_from([1, 1, 1, 2, 3]),  # n > 1: each sequence takes a slot of max_num_seqs
    ),
    max_size=60,
).map(lambda xs: [cand(i, *x) for i, x in enumerate(xs)])
budgets = st.builds(Budget, st.integers(50, 600), st.integers(1, 16))


def check_batches(batches, budget, max_batches):
    assert len(batches) <= max_batches
    for batch in batches:
        assert batch, "no empty batches"
        # sequences within max_num_seqs, unless one request of n > max_num_seqs has the batch to itself
        assert sum(c.seqs for c in batch) <= budget.max_num_seqs or len(batch) == 1
        # within the token budget, unless one oversized request has the batch to itself
        assert sum(c.cost for c in batch) <= budget.kv_tokens or len(batch) == 1


@settings(max_examples=150, deadline=None)
@given(candidates, budgets, st.integers(1, 4))
def test_every_request_packed_exactly_once_within_budget(cands, budget, max_batches):
    packer = Packer()
    pending = {c.key: c for c in cands}
    packed: list[str] = []
    for _ in range(len(cands) + 1):  # each call packs at least one request while any is pending
        if not pending:
            break
        batches = packer.pack(pending.values(), budget, max_batches)
        check_batches(batches, budget, max_batches)
        assert batches, "pending requests but nothing packed"
        top = max(c.priority for c in pending.values())
        assert any(c.priority == top for b in batches for c in b), "highest priority goes first"
        for c in (c for b in batches for c in b):
            packed.append(c.key)
            del pending[c.key]  # KeyError if a request were packed twice
    assert not pending
    assert sorted(packed, key=int) == [c.key for c in cands]


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 10), st.integers(8, 64), st.integers(2, 8), st.integers(0, 2**32),
       st.integers(0, 10**9))
def test_small_job_is_served_within_bounded_batches(n_small, hi, max_seqs, seed, history):
    rnd = random.Random(seed)
    lo = 8
    budget = Budget(kv_tokens=2 * hi, max_num_seqs=max_seqs)
    big = [cand(f"b{i}", "big", prompt=rnd.randint(1, lo), max_tokens=rnd.randint(lo, hi) - lo,
                arrival=i) for i in range(1000)]
    small = [cand(f"s{i}", "small", prompt=rnd.randint(1, lo), max_tokens=rnd.randint(lo, hi) - lo,
                  arrival=10_000 + i) for i in range(n_small)]
    packer = Packer()
    packer.served["big"] = history  # however much the big job was served before
    pending = {c.key: c for c in big + small}
    batches_until_done = 0
    while any(k.startswith("s") for k in pending):
        batches_until_done += 1
        (batch,) = packer.pack(pending.values(), budget, 1)
        for c in batch:
            del pending[c.key]
    # Each small request waits at most hi / lo batches of catch-up plus one that did not fit.
    assert batches_until_done <= n_small * (hi // lo + 2) + 1


def test_priority_strict_then_fair_share():
    budget = Budget(kv_tokens=1000, max_num_seqs=4)
    cands = ([cand(f"lo{i}", "low", priority=0, arrival=i) for i in range(4)]
             + [cand(f"a{i}", "A", priority=5, arrival=i) for i in range(10)]
             + [cand(f"b{i}", "B", priority=5, arrival=100 + i) for i in range(2)])
    (batch,) = Packer().pack(cands, budget, 1)
    keys = sorted(c.key for c in batch)
    assert keys == ["a0", "a1", "b0", "b1"]  # the later, smaller job B is not starved by A


def test_newcomer_starts_level_not_with_stale_credit():
    packer = Packer()
    budget = Budget(kv_tokens=40, max_num_seqs=2)  # two requests per batch
    pending = {f"a{i}": cand(f"a{i}", "A", arrival=i) for i in range(20)}
    for _ in range(3):
        (batch,) = packer.pack(pending.values(), budget, 1)
        for c in batch:
            del pending[c.key]
    pending.update({f"b{i}": cand(f"b{i}", "B", arrival=100 + i) for i in range(20)})
    jobs = []
    for _ in range(4):
        (batch,) = packer.pack(pending.values(), budget, 1)
        jobs.append(sorted(c.job for c in batch))
        for c in batch:
            del pending[c.key]
    assert jobs == [["A", "B"]] * 4  # shared evenly, B does not monopolise to "catch up"


def test_prefix_and_length_grouping():
    budget = Budget(kv_tokens=10_000, max_num_seqs=4)
    p1, p2 = [1] * 16, [2] * 16
    cands = [cand(i, prefix=(p1 if i % 2 else p2) + [i], prompt=17, arrival=i) for i in range(8)]
    batches = Packer().pack(cands, budget, 2)
    assert [{c.prefix[0] for c in b} for b in batches] == [{1}, {2}]
    lengths = [cand(i, prompt=p, max_tokens=0, arrival=i) for i, p in enumerate([1000, 3, 900, 5, 4, 800])]
    batches = Packer().pack(lengths, Budget(kv_tokens=10_000, max_num_seqs=3), 2)
    assert [sorted(c.prompt_tokens for c in b) for b in batches] == [[3, 4, 5], [800, 900, 1000]]


def test_requests_of_n_sequences_count_n_against_max_num_seqs():
    budget = Budget(kv_tokens=10_000, max_num_seqs=4)
    two_each = [cand(i, job=f"j{i % 2}", arrival=i, seqs=2) for i in range(6)]
    batches = Packer().pack(two_each, budget, 3)
    assert [len(b) for b in batches] == [2, 2, 2]
    mixed = [cand(0, seqs=3), cand(1, seqs=1), cand(2, seqs=2), cand(3, seqs=2)]
    batches = Packer().pack(mixed, budget, 2)
    assert sorted(sum(c.seqs for c in b) for b in batches) == [4, 4]
    (one,) = Packer().pack(mixed, budget, 1)  # what one batch can hold: the first in arrival order
    assert sorted(c.key for c in one) == ["0", "1"]


def test_oversized_request_gets_its_own_batch():
    budget = Budget(kv_tokens=100, max_num_seqs=8)
    batches = Packer().pack([cand("big", prompt=500, arrival=0), cand("s", arrival=1)], budget, 2)
    assert sorted(len(b) for b in batches) == [1, 1]


def test_budget_must_be_positive():
    with pytest.raises(ValueError, match="kv_tokens=0"):
        Budget(kv_tokens=0, max_num_seqs=1)
