"""The step scheduler's policy with fake token counts: no model, no tensors."""

from __future__ import annotations

from batchinfer.workers.engine.block_manager import BlockManager
from batchinfer.workers.engine.sequence import Sequence, SequenceStatus
from batchinfer.workers.engine.step_scheduler import SchedulerOutput, StepScheduler

BS = 4


def seq(seq_id: int, prompt_len: int, first_token: int = 0) -> Sequence:
    return Sequence(seq_id, None, 0, list(range(first_token, first_token + prompt_len)), float(seq_id))


def make(num_blocks: int = 64, budget: int = 16, max_seqs: int = 8, caching: bool = True) -> StepScheduler:
    return StepScheduler(BlockManager(num_blocks, BS, caching), budget, max_seqs)


def step(sched: StepScheduler) -> SchedulerOutput:
    """Schedule, 'run', and append a token to every sequence that reached its last token."""
    out = sched.schedule()
    sched.commit(out)
    for s in out.scheduled:
        if s.samples:
            s.seq.append_token(7)
    return out


def plan(out: SchedulerOutput) -> list[tuple[int, int, int]]:
    return [(s.seq.seq_id, s.start, s.num_new_tokens) for s in out.scheduled]


def test_running_first_then_chunked_prefill_of_waiting():
    sched = make(budget=10)
    a, b = seq(0, 3), seq(1, 25)
    sched.add(a)
    sched.add(b)
    assert plan(step(sched)) == [(0, 0, 3), (1, 0, 7)]  # b's prompt is split to the budget
    assert a.num_output_tokens == 1 and b.num_output_tokens == 0
    assert plan(step(sched)) == [(0, 3, 1), (1, 7, 9)]  # the decode goes first, b gets the rest
    out = step(sched)
    assert plan(out) == [(0, 4, 1), (1, 16, 9)] and out.scheduled[1].samples
    assert plan(step(sched)) == [(0, 5, 1), (1, 25, 1)]
    assert sched.num_running == 2 and sched.num_waiting == 0


def test_budget_caps_decodes_and_the_oldest_go_first():
    sched = make(budget=3)
    seqs = [seq(i, 1, 10 * i) for i in range(5)]
    for s in seqs:
        sched.add(s)
    assert [p[0] for p in plan(step(sched))] == [0, 1, 2]
    assert [p[0] for p in plan(step(sched))] == [0, 1, 2]  # running first: 3 and 4 keep waiting
    assert sched.num_waiting == 2


def test_max_num_seqs_caps_running():
    sched = make(budget=100, max_seqs=2)
    for i in range(4):
        sched.add(seq(i, 5, 10 * i))
    out = step(sched)
    assert [p[0] for p in plan(out)] == [0, 1] and sched.num_waiting == 2
    sched.finish(sched.running[0])
    assert [p[0] for p in plan(step(sched))] == [1, 2]


def test_preempts_the_newest_running_sequence_and_recomputes_it():
    sched = make(num_blocks=4, budget=64, caching=False)
    old, new = seq(0, 6), seq(1, 6, 100)  # 2 blocks each: the pool is full
    sched.add(old)
    sched.add(new)
    for _ in range(3):  # 8 tokens computed each: still 2 blocks
        step(sched)
    assert old.num_tokens == 9 and sched.block_manager.num_free_blocks == 0
    out = step(sched)  # old needs a third block: new is preempted
    assert out.preempted == [new] and plan(out) == [(0, 8, 1)]
    assert new.status is SequenceStatus.WAITING and new.num_computed_tokens == 0
    assert new.block_table == [] and list(sched.waiting) == [new]
    assert new.num_tokens_owed == 9  # prompt + its 3 sampled tokens, recomputed later
    sched.finish(old)
    out = step(sched)
    assert plan(out) == [(1, 0, 9)] and out.scheduled[0].samples and new.num_output_tokens == 4


def test_no_admission_in_a_step_that_preempts():
    sched = make(num_blocks=4, budget=64, caching=False)
    a, b = seq(0, 8), seq(1, 8, 100)
    sched.add(a)
    sched.add(b)
    step(sched)  # both hold 2 full blocks
    sched.add(seq(2, 1, 200))
    out = step(sched)
    assert out.preempted == [b] and [p[0] for p in plan(out)] == [0]
    assert [s.seq_id for s in sched.waiting] == [1, 2]


def test_a_sequence_preempts_itself_when_it_is_the_newest():
    sched = make(num_blocks=3, budget=64, caching=False)
    a, b = seq(0, 5), seq(1, 4, 100)  # a: 2 blocks with room, b: 1 full block
    sched.add(a)
    sched.add(b)
    step(sched)
    out = step(sched)  # a fits; b needs a second block and is itself the newest
    assert out.preempted == [b] and plan(out) == [(0, 5, 1)]
    assert list(sched.waiting) == [b] and sched.running == [a]


def test_readmitted_sequence_keeps_its_age():
    sched = make(num_blocks=4, budget=64, caching=False)
    a, b = seq(0, 8), seq(1, 8, 100)
    sched.add(a)
    sched.add(b)
    step(sched)
    step(sched)  # a grows to a third block: b is preempted
    assert sched.running == [a] and list(sched.waiting) == [b]
    sched.finish(a)
    sched.add(c := seq(2, 2, 200))
    step(sched)
    assert sched.running == [b, c]  # b is older than c: c would be preempted first


def test_prefix_hit_skips_cached_tokens_and_reports_them():
    sched = make(budget=64)
    a = seq(0, 10)
    sched.add(a)
    step(sched)
    sched.finish(a)
    b = seq(1, 10)
    sched.add(b)
    out = step(sched)
    assert plan(out) == [(1, 8, 2)] and b.num_cached_tokens == 8


def test_siblings_admitted_in_one_step_share_the_prompt_blocks():
    sched = make(budget=64)
    prompt = list(range(13))
    s0 = Sequence(0, None, 0, prompt, 0.0)
    s1 = Sequence(1, None, 1, prompt, 0.0)
    sched.add(s0)
    sched.add(s1)
    out = step(sched)
    # s1 reuses the 3 full blocks s0 is computing in this same forward; only its tail is computed.
    assert plan(out) == [(0, 0, 13), (1, 12, 1)]
    assert s1.block_table[:3] == s0.block_table[:3] and s1.block_table[3] != s0.block_table[3]


def test_prefix_caching_off_computes_everything():
    sched = make(budget=64, caching=False)
    s0, s1 = Sequence(0, None, 0, list(range(13)), 0.0), Sequence(1, None, 1, list(range(13)), 0.0)
    sched.add(s0)
    sched.add(s1)
    assert plan(step(sched)) == [(0, 0, 13), (1, 0, 13)]


def test_finish_frees_blocks_from_any_state():
    sched = make(num_blocks=8, budget=4)
    a, b = seq(0, 9), seq(1, 3, 50)
    sched.add(a)
    sched.add(b)
    step(sched)  # a is mid-prefill, b still waiting
    sched.finish(a)
    sched.finish(b)
    assert not sched.has_unfinished() and sched.block_manager.num_free_blocks == 8
    assert a.status is SequenceStatus.FINISHED and b.status is SequenceStatus.FINISHED
