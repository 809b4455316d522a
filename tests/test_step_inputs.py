"""Step inputs from the block-table rows kept across steps (issue 16) equal a from-scratch build,
and final-only requests get one output, when they finish."""

from __future__ import annotations

import random

import numpy as np
import pytest

from batchinfer.workers.engine.block_manager import BlockManager
from batchinfer.workers.engine.engine import Engine
from batchinfer.workers.engine.model_runner import BlockTableRows, ModelRunner
from batchinfer.workers.engine.outputs import RequestOutput
from batchinfer.workers.engine.sequence import Sequence, SequenceStatus
from batchinfer.workers.engine.step_scheduler import ScheduledSequence, StepScheduler
from batchinfer.workers.sampling_params import SamplingParams

BLOCK = 16


def from_scratch(runner: ModelRunner, scheduled: list[ScheduledSequence],
                 order: np.ndarray | None) -> tuple[dict[str, np.ndarray], int, int]:
    """What ``prepare`` built before the rows were kept: ``_host`` over the sequences' lists."""
    laid = scheduled if order is None else [scheduled[i] for i in order]
    rows = [(s.seq.block_table, s.start, s.num_new_tokens, s.samples) for s in laid]
    tokens = [s.seq.token_ids[s.start:s.start + s.num_new_tokens] for s in laid]
    return runner._host(rows, tokens, order)


def assert_same(got: tuple[dict[str, np.ndarray], int, int], want: tuple[dict[str, np.ndarray], int, int],
                where: str) -> None:
    assert got[1:] == want[1:], where
    assert got[0].keys() == want[0].keys(), where
    for name, array in want[0].items():
        assert got[0][name].dtype == array.dtype, f"{where}: {name}"
        np.testing.assert_array_equal(got[0][name], array, err_msg=f"{where}: {name}")


@pytest.mark.parametrize("seed", range(6))
def test_step_host_equals_a_from_scratch_build_over_random_schedules(engine_factory, seed):
    """Chunked prefills, decodes, preemptions (a small pool), prefix hits (siblings share a prompt,
    as n > 1 does), finished sequences whose rows are reclaimed (few rows: max_num_seqs 3), and
    an adapters' layout ``order``: every step's arrays equal ``_host``'s."""
    rng = random.Random(seed)
    engine = engine_factory(num_kv_blocks=9, max_num_seqs=3, max_num_batched_tokens=40)
    runner = engine.runner
    bm = BlockManager(9, BLOCK, enable_prefix_caching=True)
    sched = StepScheduler(bm, max_num_batched_tokens=rng.choice([24, 40]), max_num_seqs=3)
    prompts = [[rng.randrange(3, 300) for _ in range(rng.randrange(1, 50))] for _ in range(4)]
    seq_id = 0
    kinds = set()
    for step in range(160):
        if rng.random() < 0.3 and sched.num_waiting < 4:
            prompt = rng.choice(prompts)
            for _ in range(rng.choice([1, 1, 2])):  # two siblings: n = 2
                sched.add(Sequence(seq_id, None, 0, prompt))
                seq_id += 1
        plan = sched.schedule()
        if plan.preempted:
            kinds.add("preempted")
        if plan.is_empty:
            continue
        scheduled = plan.scheduled
        order = np.array(rng.sample(range(len(scheduled)), len(scheduled))) if rng.random() < 0.3 else None
        kinds.add("decode" if all(s.num_new_tokens == 1 for s in scheduled) else "mixed")
        assert_same(runner.step_host(scheduled, order), from_scratch(runner, scheduled, order),
                    f"seed {seed} step {step}")
        sched.commit(plan)
        for s in scheduled:
            if s.samples:
                s.seq.append_token(rng.randrange(3, 300))
                if rng.random() < 0.03 or s.seq.num_tokens >= 5 * BLOCK:
                    sched.finish(s.seq)
    assert kinds == {"decode", "mixed", "preempted"}


def test_rows_follow_appended_blocks_and_a_new_table():
    rows = BlockTableRows(2, 2)
    seq = Sequence(0, None, 0, [1, 2, 3])
    seq.status = SequenceStatus.RUNNING
    seq.block_table = [5]
    (row,) = rows.rows([seq])
    seq.block_table += [7, 9, 11]  # grown in place, past the array's width
    assert rows.rows([seq]).tolist() == [row]
    assert rows.gather(np.array([row]), 5).tolist() == [[5, 7, 9, 11, 0]]
    seq.block_table = [4]  # preempted and readmitted: a new list, fewer blocks
    assert rows.rows([seq]).tolist() == [row]
    assert rows.gather(np.array([row]), 4).tolist() == [[4, 0, 0, 0]]
    seq.block_table = [8, 6]  # and again, with more blocks than the row holds
    assert rows.rows([seq]).tolist() == [row]
    assert rows.gather(np.array([row]), 3).tolist() == [[8, 6, 0]]


def test_rows_of_stopped_sequences_are_reused_and_running_ones_kept():
    rows = BlockTableRows(2, 4)
    seqs = [Sequence(i, None, 0, [1]) for i in range(5)]
    for i, seq in enumerate(seqs):
        seq.status, seq.block_table = SequenceStatus.RUNNING, [10 + i]
    first = rows.rows(seqs[:2])
    seqs[0].status = SequenceStatus.FINISHED
    assert rows.rows([seqs[2]]).tolist() == [first[0]]  # the finished sequence's row
    # Three running sequences in two rows: the array grows; every row keeps its own table.
    got = rows.rows(seqs[1:5])
    assert len(set(got.tolist())) == 4
    assert rows.gather(got, 1).ravel().tolist() == [11, 12, 13, 14]


def test_final_only_requests_get_one_output_equal_to_the_cumulative_final(engine_factory):
    prompt = [5, 17, 42, 99, 7]
    outs = {}
    for kind in ("cumulative", "final_only"):
        engine = engine_factory()
        for n, rid in ((1, "a"), (2, "b")):
            engine.add_request(rid, prompt_token_ids=prompt, sampling_params=SamplingParams(
                n=n, max_tokens=6 + n, temperature=0.8, seed=3, ignore_eos=True, output_kind=kind))
        seen: list[tuple[str, bool]] = []
        while engine.has_unfinished():
            for out in engine.step():
                seen.append((out.request_id, out.finished))
                if out.finished:
                    outs[kind, out.request_id] = out
        if kind == "final_only":
            assert sorted(seen) == [("a", True), ("b", True)]
        else:
            assert len(seen) > 2 and all(not f for _, f in seen[:2])
    for rid in ("a", "b"):
        assert outs["final_only", rid] == outs["cumulative", rid]


def test_output_kind_is_validated_and_serialised():
    p = SamplingParams(output_kind="final_only")
    assert p.final_only and SamplingParams.from_dict(p.to_dict()) == p
    assert SamplingParams.from_dict({"output_kind": None}).output_kind == "cumulative"
    assert not SamplingParams().final_only
    for bad in ("FINAL_ONLY", "delta", 1, None):
        with pytest.raises(ValueError, match="^output_kind must be one of"):
            SamplingParams(output_kind=bad)  # type: ignore[arg-type]


def test_llm_generate_asks_for_final_outputs_only(tiny_llama):
    from batchinfer.workers.entrypoints.llm import LLM

    llm = LLM(tiny_llama, num_kv_blocks=64)
    engine = llm.engine
    assert isinstance(engine, Engine)
    seen: list[RequestOutput] = []
    step = engine.step

    def recording_step() -> list[RequestOutput]:  # the real step; what it hands out is kept
        outs = step()
        seen.extend(outs)
        return outs

    engine.step = recording_step  # type: ignore[method-assign]
    params = SamplingParams(max_tokens=5, ignore_eos=True, temperature=0.0)
    prompts = [{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": [8, 9]}]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.finished for o in seen] == [True, True]
    assert [len(o.outputs[0].token_ids) for o in outs] == [5, 5]
    assert params.output_kind == "cumulative"  # the caller's params are left as they were
