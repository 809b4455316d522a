"""Block pool invariants: reference counts, prefix caching, LRU eviction, no leaks.

The hypothesis test drives the real scheduler with a fake model that writes token ids into a
simulated KV cache, so a block shared, evicted or reused wrongly shows up as a wrong token.
"""

from __future__ import annotations

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from batchinfer.workers.engine.block_manager import BlockManager
from batchinfer.workers.engine.sequence import Sequence, SequenceStatus
from batchinfer.workers.engine.step_scheduler import StepScheduler

BS = 4


def make_seq(seq_id: int, tokens: list[int]) -> Sequence:
    return Sequence(seq_id, None, 0, tokens, arrival_time=float(seq_id))


def admit(bm: BlockManager, seq: Sequence) -> int:
    """Allocate a whole prompt the way the scheduler admits it; returns the cached tokens."""
    cached = bm.find_cached_prefix(seq)
    hit = len(cached) * bm.block_size
    assert bm.allocate(seq, seq.num_tokens - hit, cached)
    seq.num_computed_tokens = seq.num_tokens
    return hit


def check_invariants(bm: BlockManager, live: list[Sequence]) -> None:
    refs = Counter(b for s in live for b in s.block_table)
    for s in live:
        assert len(set(s.block_table)) == len(s.block_table), "a block twice in one table"
    for b in range(bm.num_blocks):
        assert bm.ref_counts[b] == refs.get(b, 0), f"block {b}: ref count {bm.ref_counts[b]}"
        assert (b in bm.free_queue) == (bm.ref_counts[b] == 0)
        h = bm.block_hash[b]
        assert h is None or bm.cached[h] == b
    for h, b in bm.cached.items():
        assert bm.block_hash[b] == h


def test_allocate_and_free_counts_blocks():
    bm = BlockManager(num_blocks=8, block_size=BS)
    seq = make_seq(0, list(range(10)))
    assert bm.allocate(seq, 10)
    assert len(seq.block_table) == 3 and bm.num_free_blocks == 5
    seq.num_computed_tokens = 10
    assert bm.allocate(seq, 2)  # fills block 3 exactly: no new block
    assert len(seq.block_table) == 3
    seq.num_computed_tokens = 12
    assert bm.allocate(seq, 1)
    assert len(seq.block_table) == 4
    check_invariants(bm, [seq])
    bm.free(seq)
    assert bm.num_free_blocks == 8 and seq.block_table == []
    check_invariants(bm, [])


def test_allocation_fails_without_side_effects_when_full():
    bm = BlockManager(num_blocks=2, block_size=BS)
    a, b = make_seq(0, [1] * 8), make_seq(1, [2] * 3)
    assert bm.allocate(a, 8)
    assert not bm.allocate(b, 3)
    assert b.block_table == [] and bm.num_free_blocks == 0
    check_invariants(bm, [a])


def test_shared_prefix_hits_full_blocks_and_leaves_last_token():
    bm = BlockManager(num_blocks=16, block_size=BS)
    a = make_seq(0, list(range(12)))
    assert admit(bm, a) == 0
    b = make_seq(1, list(range(12)))  # identical: the last block is recomputed for the logits
    assert admit(bm, b) == 8
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] != a.block_table[2]
    c = make_seq(2, list(range(6)) + [99, 98, 97])  # diverges inside block 1
    assert admit(bm, c) == 4
    assert bm.ref_counts[a.block_table[0]] == 3
    check_invariants(bm, [a, b, c])
    assert bm.prefix_hit_rate == (0 + 8 + 4) / (12 + 12 + 9)


def test_hashes_are_chained_so_a_block_only_hits_after_the_same_prefix():
    bm = BlockManager(num_blocks=16, block_size=BS)
    a = make_seq(0, [1, 2, 3, 4, 9, 9, 9, 9, 0])
    admit(bm, a)
    assert bm.find_cached_prefix(make_seq(1, [9, 9, 9, 9, 0])) == []
    assert bm.find_cached_prefix(make_seq(2, [1, 2, 3, 4, 1, 2, 3, 4, 0])) == a.block_table[:1]
    assert bm.find_cached_prefix(make_seq(3, [1, 2, 3, 4, 9, 9, 9, 9, 5])) == a.block_table[:2]


def test_freed_cached_blocks_are_reused_then_evicted_lru():
    bm = BlockManager(num_blocks=4, block_size=BS)
    a = make_seq(0, list(range(9)))  # 3 blocks, the first 2 full and cached
    admit(bm, a)
    a_blocks = list(a.block_table)
    bm.free(a)
    # The partial block goes to the front of the free queue, the cached prefix to the back.
    other = make_seq(1, [50, 51, 52, 53, 54])
    admit(bm, other)
    assert a_blocks[2] in other.block_table and not set(a_blocks[:2]) & set(other.block_table)
    assert bm.find_cached_prefix(make_seq(2, list(range(9)))) == a_blocks[:2]
    other_blocks = list(other.block_table)
    bm.free(other)
    # Two new blocks: the un-hashed one first, then the least recently freed cached one (a's
    # second block: a's tail was freed before its head), which breaks a's chain after block 0.
    fresh = make_seq(3, list(range(100, 108)))
    admit(bm, fresh)
    assert a_blocks[1] in fresh.block_table
    assert bm.find_cached_prefix(make_seq(4, list(range(9)))) == a_blocks[:1]
    assert bm.find_cached_prefix(make_seq(5, [50, 51, 52, 53, 54])) == [other_blocks[0]]
    check_invariants(bm, [fresh])


def test_prefix_caching_off_never_hits():
    bm = BlockManager(num_blocks=8, block_size=BS, enable_prefix_caching=False)
    a = make_seq(0, list(range(12)))
    admit(bm, a)
    assert bm.find_cached_prefix(make_seq(1, list(range(12)))) == []
    assert bm.cached == {}


# -- random workloads through the real scheduler ------------------------------------------------

prompts = st.lists(st.integers(0, 3), min_size=1, max_size=20)  # small alphabet: shared prefixes
workload = st.lists(
    st.tuples(prompts, st.integers(1, 12), st.integers(0, 3)),  # prompt, max new tokens, abort-at
    min_size=1, max_size=12,
)


@settings(max_examples=60, deadline=None)
@given(workload, st.integers(6, 20), st.sampled_from([4, 7, 64]), st.booleans())
def test_random_workloads_keep_kv_consistent_and_leak_nothing(work, num_blocks, budget, caching):
    bm = BlockManager(num_blocks=num_blocks, block_size=BS, enable_prefix_caching=caching)
    sched = StepScheduler(bm, max_num_batched_tokens=budget, max_num_seqs=5)
    kv: dict[int, tuple[int, int]] = {}  # slot -> (position, token id): the simulated cache
    limit = num_blocks * BS  # max_model_len: one sequence always fits the pool alone
    seqs, max_new, abort_at = [], {}, {}
    for i, (prompt, new, abort) in enumerate(work):
        seq = make_seq(i, prompt[: limit - 1])
        seqs.append(seq)
        max_new[i], abort_at[i] = new, abort
        sched.add(seq)
    steps = 0
    while sched.has_unfinished():
        steps += 1
        assert steps < 2000, "no progress"
        out = sched.schedule()
        assert not out.is_empty, "an empty step with work pending"
        assert out.num_batched_tokens <= budget and len(out.scheduled) <= 5
        for s in out.scheduled:  # the "model": write K/V, then check the context it attends to
            table = s.seq.block_table
            for p in range(s.start, s.start + s.num_new_tokens):
                kv[table[p // BS] * BS + p % BS] = (p, s.seq.token_ids[p])
        for s in out.scheduled:
            seq, end = s.seq, s.start + s.num_new_tokens
            ctx = [kv.get(seq.block_table[p // BS] * BS + p % BS) for p in range(end)]
            assert ctx == list(enumerate(seq.token_ids[:end])), "attends to a wrong token"
        sched.commit(out)
        for s in out.scheduled:
            seq = s.seq
            if not s.samples:
                continue
            seq.append_token(seq.num_tokens % 4)
            done = seq.num_output_tokens >= max_new[seq.seq_id] or seq.num_tokens >= limit
            if done or seq.num_output_tokens == abort_at[seq.seq_id]:
                sched.finish(seq)
        check_invariants(bm, [s for s in seqs if s.status is SequenceStatus.RUNNING])
    assert bm.num_free_blocks == num_blocks and all(c == 0 for c in bm.ref_counts)
    # Cached prefixes hit: a prompt run to the end and freed is found again in full.
    if caching:
        first = make_seq(100, seqs[0].token_ids[: limit - 1])
        admit(bm, first)
        bm.free(first)
        again = make_seq(101, first.token_ids)
        assert admit(bm, again) == (again.num_tokens - 1) // BS * BS
        bm.free(again)
