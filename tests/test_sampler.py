"""Sampler: each logits processor against its definition, seeds, greedy, logprobs."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from batchinfer.kernels.sampling import apply_min_p, apply_top_k_top_p, signed64
from batchinfer.workers.engine.sampler import Sampler, SamplingBatch, SamplingRow, make_generator
from batchinfer.workers.sampling_params import SamplingParams

V = 12
EOS = 11


@pytest.fixture(autouse=True)
def _fixed_global_rng():
    """Unseeded rows use the global RNG: fix it so statistical checks are deterministic."""
    state = torch.random.get_rng_state()
    torch.manual_seed(1234)
    yield
    torch.random.set_rng_state(state)


def row(prompt=(1, 2), output=(), generator=None, **params) -> SamplingRow:
    return SamplingRow(SamplingParams(**params), list(prompt), list(output), generator)


def draw_counts(logits_row: torch.Tensor, n: int, **params) -> torch.Tensor:
    """Sample n times from one row's logits (one batch of n identical rows); counts per token."""
    out = Sampler(logits_row.shape[0], [EOS])(logits_row.expand(n, -1).clone(), [row(**params)] * n)
    return torch.bincount(torch.tensor(out.token_ids), minlength=logits_row.shape[0])


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's statistic over tokens with positive expected probability."""
    n = counts.sum().item()
    keep = probs > 0
    expected = probs[keep].double() * n
    return (((counts[keep].double() - expected) ** 2) / expected).sum().item()


# 99.9th percentile of chi-square with df degrees of freedom (Wilson–Hilferty), a loose bound.
def chi2_bound(df: int) -> float:
    z = 3.09
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


PROBS = torch.tensor([0.30, 0.20, 0.15, 0.12, 0.08, 0.06, 0.04, 0.02, 0.015, 0.01, 0.004, 0.001])
LOGITS = PROBS.log()


# -- definitions of the filters ------------------------------------------------------------------


def reference_survivors(logits: torch.Tensor, top_k: int, top_p: float, min_p: float) -> set[int]:
    """The filters' definitions, in float64 on a plain Python list."""
    values = logits.double().tolist()
    ranked = sorted(range(len(values)), key=lambda i: -values[i])
    alive = set(range(len(values)))
    if top_k:
        kth = values[ranked[top_k - 1]]
        alive = {i for i in alive if values[i] >= kth}
    z = sum(math.exp(values[i]) for i in alive)
    mass = 0.0
    for i in ranked:  # the token at which the mass reaches top_p sets the boundary; ties survive
        if i in alive:
            mass += math.exp(values[i]) / z
            if mass >= top_p:
                alive = {j for j in alive if values[j] >= values[i]}
                break
    best = max(values[i] for i in alive)
    return {i for i in alive if math.exp(values[i] - best) >= min_p}


def survivors(masked: torch.Tensor) -> set[int]:
    """Token ids left unmasked in a one-row [1, V] tensor."""
    assert masked.shape[0] == 1
    return set(torch.nonzero(masked[0] > float("-inf")).flatten().tolist())


def test_top_k_keeps_k_best_and_ties():
    logits = torch.tensor([[1.0, 5.0, 3.0, 3.0, 0.0, 4.0]])
    full = torch.tensor([1.0])
    assert survivors(apply_top_k_top_p(logits, torch.tensor([2]), full)) == {1, 5}
    assert survivors(apply_top_k_top_p(logits, torch.tensor([3]), full)) == {1, 5, 2, 3}  # tie at k-th
    assert survivors(apply_top_k_top_p(logits, torch.tensor([6]), full)) == set(range(6))


def test_top_p_keeps_smallest_set_reaching_p():
    logits = torch.tensor([0.05, 0.4, 0.1, 0.3, 0.15]).log().unsqueeze(0)
    k = torch.tensor([5])
    assert survivors(apply_top_k_top_p(logits, k, torch.tensor([0.35]))) == {1}
    assert survivors(apply_top_k_top_p(logits, k, torch.tensor([0.65]))) == {1, 3}
    assert survivors(apply_top_k_top_p(logits, k, torch.tensor([0.75]))) == {1, 3, 4}
    assert survivors(apply_top_k_top_p(logits, k, torch.tensor([1.0]))) == set(range(5))
    assert survivors(apply_top_k_top_p(logits, k, torch.tensor([1e-6]))) == {1}
    # mass exactly reaching top_p is enough (0.25 each, exact in float); ties at the boundary survive
    flat = torch.tensor([[0.0, 0.0, -100.0, -100.0, -100.0]])
    assert survivors(apply_top_k_top_p(flat, torch.tensor([5]), torch.tensor([0.5]))) == {0, 1}
    flat = torch.zeros(1, 4)
    assert survivors(apply_top_k_top_p(flat, torch.tensor([4]), torch.tensor([0.5]))) == {0, 1, 2, 3}


def test_top_p_beyond_the_candidates_falls_back_to_a_full_sort():
    logits = torch.randn(3, 500) * 0.1  # flat: the nucleus holds hundreds of tokens
    k, p = torch.tensor([500, 500, 3]), torch.tensor([0.9, 0.3, 0.9])
    narrow = apply_top_k_top_p(logits, k, p, candidates=8)
    assert torch.equal(narrow, apply_top_k_top_p(logits, k, p, candidates=500))
    assert 400 < (narrow[0] > float("-inf")).sum() < 500 and (narrow[2] > float("-inf")).sum() == 3


def test_top_p_applies_to_the_renormalised_top_k():
    logits = torch.tensor([0.05, 0.4, 0.1, 0.3, 0.15]).log().unsqueeze(0)
    # after top-2 the masses are 4/7 and 3/7: top_p 0.5 keeps only the best one
    assert survivors(apply_top_k_top_p(logits, torch.tensor([2]), torch.tensor([0.5]))) == {1}
    assert survivors(apply_top_k_top_p(logits, torch.tensor([2]), torch.tensor([0.6]))) == {1, 3}


def test_min_p_keeps_tokens_above_fraction_of_max():
    logits = torch.tensor([0.05, 0.4, 0.1, 0.3, 0.15]).log().unsqueeze(0)
    assert survivors(apply_min_p(logits, torch.tensor([0.3]))) == {1, 3, 4}  # >= 0.12
    assert survivors(apply_min_p(logits, torch.tensor([0.0]))) == set(range(5))
    assert survivors(apply_min_p(logits, torch.tensor([1.0]))) == {1}


def test_rows_are_filtered_independently():
    logits = torch.stack([LOGITS, LOGITS.flip(0)])
    masked = apply_top_k_top_p(logits, torch.tensor([1, 12]), torch.tensor([1.0, 1.0]))
    assert survivors(masked[:1]) == {0} and survivors(masked[1:]) == set(range(12))


@settings(max_examples=200, deadline=None)
@given(
    values=st.lists(st.floats(-8, 8, width=32), min_size=2, max_size=40),
    top_k=st.integers(0, 40),
    top_p=st.floats(0.01, 1.0),
    min_p=st.floats(0.0, 1.0),
    candidates=st.integers(1, 8),
)
def test_filters_match_their_definitions(values, top_k, top_p, min_p, candidates):
    logits = torch.tensor([values])
    v = len(values)
    top_k = min(top_k, v)
    # stay away from boundaries where float32 and float64 may disagree
    ref_k = sorted(values, reverse=True)
    if top_k:
        alive = [x for x in values if x >= ref_k[top_k - 1]]
    else:
        alive = values
    z = sum(math.exp(x) for x in alive)
    cum = 0.0
    for x in sorted(alive, reverse=True):
        cum += math.exp(x) / z
        assume(abs(cum - top_p) > 1e-4)
    masked = apply_top_k_top_p(logits, torch.tensor([top_k or v]), torch.tensor([top_p]), candidates)
    finite = masked[masked > float("-inf")]
    best = finite.max().item()
    assume(all(abs(math.exp(x - best) - min_p) > 1e-5 for x in finite.tolist()))
    masked = apply_min_p(masked, torch.tensor([min_p]))
    assert survivors(masked) == reference_survivors(logits[0], top_k, top_p, min_p)


# -- sampling distributions ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("params", "allowed"),
    [
        ({"top_k": 3}, {0, 1, 2}),
        ({"top_p": 0.6}, {0, 1, 2}),  # 0.30 + 0.20 = 0.50 < 0.6 <= 0.65
        ({"min_p": 0.25}, {0, 1, 2, 3, 4}),  # p >= 0.075
        ({"top_k": 4, "top_p": 0.9}, {0, 1, 2, 3}),
        ({}, set(range(V))),
    ],
)
def test_sampling_follows_the_renormalised_distribution(params, allowed):
    n = 20000
    counts = draw_counts(LOGITS, n, **params)
    assert set(torch.nonzero(counts).flatten().tolist()) <= allowed  # never a removed token
    expected = torch.zeros(V)
    expected[list(allowed)] = PROBS[list(allowed)]
    expected /= expected.sum()
    # every allowed token with a real share shows up
    assert all(counts[i] > 0 for i in allowed if expected[i] * n > 20)
    assert chi_square(counts, expected) < chi2_bound(len(allowed) - 1)


def test_temperature_sharpens_and_flattens():
    n = 20000
    for t in (0.5, 2.0):
        counts = draw_counts(LOGITS, n, temperature=t)
        expected = torch.softmax(LOGITS / t, dim=0)
        assert chi_square(counts, expected) < chi2_bound(V - 1)
    # and the statistic does tell distributions apart
    assert chi_square(draw_counts(LOGITS, n, temperature=0.5), PROBS) > 10 * chi2_bound(V - 1)


# -- greedy and penalties ------------------------------------------------------------------------


def test_greedy_is_exact_argmax():
    logits = torch.randn(64, 1000)
    out = Sampler(1000, [EOS])(logits, [row(temperature=0.0, top_k=5, top_p=0.1)] * 64)
    assert out.token_ids == logits.argmax(-1).tolist()


def test_repetition_penalty_matches_transformers():
    transformers = pytest.importorskip("transformers")
    logits = torch.randn(3, 50) * 4
    prompts, outputs = [[1, 2, 3], [7, 7, 8], [40]], [[4, 2], [], [9, 9, 49]]
    rows = [row(prompt=p, output=o, repetition_penalty=1.7) for p, o in zip(prompts, outputs, strict=True)]
    processed = Sampler(50, [EOS]).apply_penalties(logits, rows)
    processor = transformers.RepetitionPenaltyLogitsProcessor(penalty=1.7)
    for i in range(3):
        expected = processor(torch.tensor([prompts[i] + outputs[i]]), logits[i : i + 1].clone())
        assert torch.equal(processed[i : i + 1], expected)  # bit for bit: greedy must match generate


def test_frequency_and_presence_penalties_by_hand():
    logits = torch.tensor([[3.0, 2.9, 2.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    rows = [row(prompt=[1, 1, 2], output=[0, 0, 3], frequency_penalty=0.4, presence_penalty=0.5),
            row(prompt=[0, 0], output=[3, 3, 3], frequency_penalty=-1.5)]  # the prompt does not count
    processed = Sampler(4, []).apply_penalties(logits, rows)
    expected = torch.tensor([[3.0 - 2 * 0.4 - 0.5, 2.9, 2.0, 0.0 - 0.4 - 0.5],
                             [1.0, 1.0, 1.0, 1.0 + 3 * 1.5]])
    torch.testing.assert_close(processed, expected, rtol=0, atol=1e-6)
    out = Sampler(4, [])(logits, [row(output=[0, 0, 3], temperature=0, frequency_penalty=0.4,
                                      presence_penalty=0.5)] * 2)
    assert out.token_ids == [1, 1]  # 1.7 < 2.9; on [1, 1, 1, 1] tokens 1 and 2 tie: the lowest id wins
    assert torch.equal(logits, torch.tensor([[3.0, 2.9, 2.0, 0.0], [1.0, 1.0, 1.0, 1.0]]))  # not modified


def test_repetition_penalty_by_hand():
    logits = torch.tensor([[5.0, 4.0, -1.0, 0.5, -2.0]])
    rows = [row(prompt=[0, 2], output=[2, 4], repetition_penalty=2.0)]
    processed = Sampler(5, []).apply_penalties(logits, rows)
    torch.testing.assert_close(processed, torch.tensor([[2.5, 4.0, -2.0, 0.5, -4.0]]), rtol=0, atol=0)


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    logits = torch.tensor([[0.0] * 10 + [5.0, 9.0]])  # EOS (11) best, then token 10
    sampler = Sampler(V, [EOS])
    params = {"temperature": 0, "min_tokens": 3, "stop_token_ids": [10]}
    assert sampler(logits, [row(output=[1, 2], **params)]).token_ids == [0]
    assert sampler(logits, [row(output=[1, 2, 3], **params)]).token_ids == [EOS]
    # ignore_eos: EOS is an ordinary token, only the stop ids are held back
    assert sampler(logits, [row(output=[1], ignore_eos=True, **params)]).token_ids == [EOS]
    # random sampling never ends early either
    out = sampler(logits.expand(500, -1).clone(), [row(output=[1], min_tokens=2, stop_token_ids=[10])] * 500)
    assert EOS not in out.token_ids and 10 not in out.token_ids


def test_padded_vocabulary_columns_are_never_chosen():
    logits = torch.zeros(2, 16)
    logits[:, 12:] = 100.0  # padding of the embedding matrix
    out = Sampler(V, [EOS])(logits, [row(temperature=0), row()])
    assert all(t < V for t in out.token_ids)
    with pytest.raises(ValueError, match="logits must be"):
        Sampler(V, [EOS])(torch.zeros(2, 8), [row(), row()])


# -- the batch's metadata ------------------------------------------------------------------------


def batch_state(batch: SamplingBatch) -> dict[str, object]:
    """Every array, tensor and index set the batch holds, as comparable values."""
    state: dict[str, object] = {}
    for name, value in vars(batch).items():
        if isinstance(value, (torch.Tensor, np.ndarray)):
            state[name] = (value.dtype, value.shape, value.tolist())
        elif name == "rows":
            state[name] = [id(r) for r in value]
        else:
            state[name] = value
    return state


def built_from_scratch(rows: list[SamplingRow]) -> SamplingBatch:
    batch = SamplingBatch(V, [EOS])
    batch.update(rows)
    return batch


def test_batch_updated_row_by_row_equals_one_built_from_scratch():
    kinds = [dict(temperature=0), dict(temperature=0.7, top_p=0.9), dict(top_k=3, min_p=0.1),
             dict(seed=5), dict(repetition_penalty=1.2, logprobs=2), dict(min_tokens=2, stop_token_ids=[4]),
             dict(frequency_penalty=0.5, presence_penalty=0.1, ignore_eos=True, min_tokens=1), dict()]
    rows = [row(generator=make_generator(p["seed"], 0) if "seed" in p else None, **p) for p in kinds]
    batch = SamplingBatch(V, [EOS])
    steps = [rows[:3], rows[:5],  # rows join
             rows[1:5], [rows[1], rows[4]],  # rows leave
             [rows[4], rows[1]], rows[::-1], [rows[0]] + rows[3:6] + [rows[2]],  # reordered, mixed
             [rows[7], rows[7], rows[3]],  # one row twice (as tests pass [row] * n)
             [], rows]
    for step in steps:
        batch.update(step)
        assert batch_state(batch) == batch_state(built_from_scratch(step))


def test_batch_arrays_hold_the_rows_params():
    rows = [row(temperature=0), row(temperature=0.5, top_k=50, top_p=0.8), row(temperature=2.0, min_p=0.3,
            seed=9, generator=make_generator(9, 1)), row(logprobs=0, repetition_penalty=1.5)]
    batch = built_from_scratch(rows)
    assert batch.random_rows.tolist() == [1, 2, 3] and not batch.all_random
    assert batch.temperature.squeeze(1).tolist() == torch.tensor([0.5, 2.0, 1.0]).tolist()
    assert batch.filtered is not None and batch.filtered.tolist() == [0]
    assert batch.top_k.tolist() == [V] and batch.top_p.tolist() == torch.tensor([0.8]).tolist()
    assert batch.min_p is not None and batch.min_p.tolist() == torch.tensor([0.0, 0.3, 0.0]).tolist()
    assert batch.seeded.tolist() == [1] and batch.seeded_rows == [2]
    assert batch.seed_keys.tolist() == [signed64(make_generator(9, 1).initial_seed())]
    assert batch.logprob_rows == [3] and batch.logprob_counts == [0] and batch.repetition_rows == [3]


# -- seeds ---------------------------------------------------------------------------------------


def run_steps(position: int, others: list[SamplingRow], steps: int = 25) -> list[int]:
    """Sample a seeded completion for several steps at a given position among other rows."""
    logits_gen = torch.Generator().manual_seed(99)
    tokens: list[int] = []
    gen = make_generator(7, 0)
    sampler = Sampler(200, [EOS])
    for _ in range(steps):
        mine = torch.randn(200, generator=logits_gen)
        target = row(output=tokens, generator=gen, temperature=0.9, top_p=0.95, seed=7)
        rows = others[:position] + [target] + others[position:]
        logits = torch.randn(len(rows), 200)
        logits[position] = mine
        tokens.append(sampler(logits, rows).token_ids[position])
    return tokens


def test_seeded_tokens_do_not_depend_on_the_batch():
    alone = run_steps(0, [])
    others = [row(), row(temperature=0), row(top_k=3, generator=make_generator(1, 0), seed=1),
              row(min_p=0.2, presence_penalty=1.0, output=[5]), row(repetition_penalty=1.3)]
    assert run_steps(3, others) == alone
    assert run_steps(5, others) == alone
    assert run_steps(1, others[:2]) == alone
    assert len(set(alone)) > 5  # it is really sampling


def test_make_generator_is_reproducible_and_distinct_per_completion():
    def draw(seed, index):
        return torch.rand(8, generator=make_generator(seed, index)).tolist()

    assert draw(3, 0) == draw(3, 0)
    assert draw(3, 1) == draw(3, 1)
    assert draw(3, 0) != draw(3, 1)
    assert draw(3, 1) != draw(4, 0)  # not seed + index
    assert draw(-5, 0) == draw(-5, 0) and draw(2**64 - 1, 2) == draw(2**64 - 1, 2)


def test_n_completions_with_one_seed_differ_and_reproduce():
    logits = torch.zeros(4, 1000)  # uniform: completions can only agree by chance
    sampler = Sampler(1000, [EOS])

    def complete() -> list[list[int]]:
        gens = [make_generator(11, i) for i in range(4)]
        seqs: list[list[int]] = [[] for _ in range(4)]
        for _ in range(10):
            rows = [row(output=s, generator=g, seed=11) for s, g in zip(seqs, gens, strict=True)]
            out = sampler(logits, rows)
            for s, t in zip(seqs, out.token_ids, strict=True):
                s.append(t)
        return seqs

    first = complete()
    torch.manual_seed(0)  # the global RNG must not matter
    assert complete() == first
    assert len({tuple(s) for s in first}) == 4


# -- logprobs ------------------------------------------------------------------------------------


def test_logprobs_come_from_the_raw_distribution():
    logits = torch.randn(3, 30) * 3
    rows = [row(logprobs=5, temperature=0.7, top_k=2, repetition_penalty=1.5, output=[4]),
            row(logprobs=0, temperature=0),
            row()]
    out = Sampler(30, [EOS])(logits, rows)
    raw = torch.log_softmax(logits, dim=-1)
    lp0 = out.logprobs[0]
    top5 = raw[0].topk(5).indices.tolist()
    assert set(lp0) == set(top5) | {out.token_ids[0]}
    assert list(lp0)[0] == out.token_ids[0]  # the sampled token comes first
    for t, v in lp0.items():
        assert v.logprob == pytest.approx(raw[0, t].item(), abs=1e-6)
        assert v.rank == int((raw[0] > raw[0, t]).sum()) + 1  # 1-based rank in the raw distribution
    (only,) = out.logprobs[1].items()
    assert only[0] == out.token_ids[1] and only[1].logprob == pytest.approx(raw[1, only[0]].item(), abs=1e-6)
    assert only[1].rank == 1  # greedy: the argmax of the unprocessed logits
    assert out.logprobs[2] is None
    assert Sampler(30, [EOS])(logits, [row(), row(), row()]).logprobs == [None, None, None]


def test_logprob_ranks_of_a_sampled_token_outside_the_top_k():
    # a flat distribution (temperature 5): some seed samples a token below the top 2
    logits = torch.tensor([[5.0, 4.0, 3.0, 2.0, 1.0, 0.0]])
    for seed in range(40):
        out = Sampler(6, [EOS])(logits, [row(logprobs=2, temperature=5.0, seed=seed,
                                             generator=make_generator(seed, 0))])
        token = out.token_ids[0]
        lp = out.logprobs[0]
        assert [lp[t].rank for t in (0, 1)] == [1, 2]
        assert lp[token].rank == token + 1  # the logits are in descending order: rank = id + 1
        if token > 1:
            assert list(lp) == [token, 0, 1] and len(lp) == 3
            break
    else:
        raise AssertionError("no seed sampled a token outside the top 2")


def test_logprob_ranks_with_ties_keep_the_top_k_at_1_to_k():
    logits = torch.tensor([[2.0, 2.0, 2.0, -9.0]])
    out = Sampler(4, [EOS])(logits, [row(logprobs=1, temperature=0)])
    lp = out.logprobs[0]
    ranks = sorted(v.rank for v in lp.values())
    assert ranks[0] == 1 and (len(lp) == 1 or ranks == [1, 2])  # a tied token outside the top 1 ranks 2
