"""The batched host paths of an engine step (issue 16): counter-based seeded draws, the sorted
top-k / top-p threshold, bulk detokenisation, and the engine wired to them."""

from __future__ import annotations

import itertools
import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from batchinfer.kernels.sampling import (
    MASK64,
    _nucleus_threshold,
    _sorted_threshold,
    counter_uniforms,
    splitmix64,
)
from batchinfer.workers.engine.sampler import Sampler, SamplingRow, make_generator
from batchinfer.workers.models.tiny import build_tokenizer
from batchinfer.workers.sampling_params import SamplingParams
from batchinfer.workers.text.detokenizer import IncrementalDetokenizer, append_tokens
from batchinfer.workers.text.stopping import check_stop, is_stop_token

GOLDEN = 0x9E3779B97F4A7C15


def reference_uniform(key: int, counter: int) -> float:
    """counter_uniforms in Python's unbounded integers: splitmix64 at state key + counter * golden."""
    return (splitmix64((key + counter * GOLDEN) & MASK64) >> 11) * 2.0**-53


def test_counter_uniforms_match_splitmix64_in_python_integers():
    keys = [0, 1, 2**63 - 1, 2**63, 2**64 - 1, make_generator(7, 0).initial_seed(), 0xDEADBEEFCAFEF00D]
    counters = [0, 1, 5, 1000, 2**31]
    pairs = [(k, c) for k in keys for c in counters]
    signed = [k - 2**64 if k >= 2**63 else k for k, _ in pairs]
    got = counter_uniforms(torch.tensor(signed, dtype=torch.int64),
                           torch.tensor([c for _, c in pairs], dtype=torch.int64)).tolist()
    assert got == [reference_uniform(k, c) for k, c in pairs]  # exact: the same integers
    assert all(0.0 <= u < 1.0 for u in got) and len(set(got)) == len(got)


def test_seeded_draws_leave_the_generator_alone_and_follow_the_output_position():
    gen = make_generator(5, 0)
    state = gen.get_state().clone()
    logits = torch.zeros(1, 1000)  # uniform
    sampler = Sampler(1000, [0])

    def token(position: int) -> int:
        return sampler(logits, [SamplingRow(SamplingParams(seed=5), [1], [3] * position, gen)]).token_ids[0]

    first = [token(i) for i in range(20)]
    assert torch.equal(gen.get_state(), state)  # only the seed was read
    assert [token(i) for i in range(20)] == first  # a draw is a function of (seed, index, position)
    assert len(set(first)) > 15
    # the token is the one the counter uniform selects from the uniform distribution
    keys = torch.tensor([gen.initial_seed() - 2**64 if gen.initial_seed() >= 2**63 else gen.initial_seed()])
    assert first[3] == int(counter_uniforms(keys, torch.tensor([3])).item() * 1000)


def test_seeded_rows_in_a_full_batch_match_their_draws_alone():
    torch.manual_seed(0)
    logits = torch.randn(256, 320) * 2
    rows = [SamplingRow(SamplingParams(temperature=0.8, top_p=0.9, seed=i), [1], [4] * (i % 7),
                        make_generator(i, 0)) for i in range(256)]
    together = Sampler(320, [0])(logits, rows).token_ids
    alone = [Sampler(320, [0])(logits[i:i + 1], [rows[i]]).token_ids[0] for i in range(0, 256, 17)]
    assert together[::17] == alone


def sorted_top_p(row: torch.Tensor, top_p: float) -> torch.Tensor:
    return _sorted_threshold(row, torch.tensor([row.shape[1]]), torch.tensor([top_p]))


@settings(max_examples=150, deadline=None)
@given(values=st.lists(st.sampled_from([-1e9, -5.5, -1.0, -0.0, 0.0, 0.25, 1.0, 3.0, 7.5])
                       | st.floats(-20, 20), min_size=1, max_size=60),
       top_p=st.floats(0.001, 0.999), masked=st.integers(0, 5))
def test_sorted_threshold_equals_the_cumulative_sum_of_the_candidates(values, top_p, masked):
    row = torch.tensor([values], dtype=torch.float32)
    row[0, :min(masked, len(values) - 1)] = float("-inf")  # masked tokens: no mass
    p = torch.tensor([top_p])
    ranked = row.sort(dim=-1, descending=True).values
    expected, found = _nucleus_threshold(row.logsumexp(dim=-1, keepdim=True), ranked, p)
    got = sorted_top_p(row, top_p)
    assert got.item() in row[0].tolist()  # a logit of the row
    if found.item():
        # equal mass at a boundary may round either way
        mass = lambda t: float(torch.softmax(row, -1)[row >= t].sum())  # noqa: E731
        assert got.item() == expected.item() or abs(mass(got.item()) - top_p) < 1e-5
    else:  # the candidates' float32 sum fell short of top_p: the sorted one keeps nearly all
        assert float(torch.softmax(row, -1)[row >= got.item()].sum()) >= top_p - 1e-5


@settings(max_examples=100, deadline=None)
@given(values=st.lists(st.floats(-20, 20, width=32), min_size=1, max_size=40),
       top_k=st.integers(1, 45), top_p=st.floats(0.001, 1.0))
def test_sorted_threshold_applies_top_p_to_the_top_k(values, top_k, top_p):
    row = torch.tensor([values], dtype=torch.float32)
    v = len(values)
    p = torch.tensor([top_p])  # float32, as the sampler holds it: 0.9999999999999999 is 1.0 (off)
    got = _sorted_threshold(row, torch.tensor([top_k]), p).item()
    top_p = p.item()
    kth = sorted(values, reverse=True)[min(top_k, v) - 1]
    if top_p >= 1.0:
        assert got == (kth if top_k < v else float("-inf"))
        return
    alive = sorted((x for x in values if x >= kth), reverse=True)
    z = sum(math.exp(x - alive[0]) for x in alive)
    cums = list(itertools.accumulate(math.exp(x - alive[0]) / z for x in alive))  # float64 reference
    boundary = next((x for x, c in zip(alive, cums, strict=True) if c >= top_p), alive[-1])
    assert got in alive and got >= kth
    if all(abs(c - top_p) > 1e-5 for c in cums):  # not within rounding of a boundary
        assert got == boundary


def test_sorted_threshold_rows_do_not_depend_on_each_other():
    torch.manual_seed(1)
    logits = torch.randn(64, 500)
    p = torch.rand(64) * 0.9 + 0.05
    k = torch.randint(1, 600, (64,))
    whole = _sorted_threshold(logits, k, p)
    for i in (0, 13, 63):
        assert torch.equal(whole[i], _sorted_threshold(logits[i:i + 1], k[i:i + 1], p[i:i + 1])[0])


def test_append_tokens_equals_appending_one_by_one():
    tok = build_tokenizer()
    texts = ["héllo 世界 🙂 ok", "plain words here", "🙂🙂 ünïcödé", "a"]
    streams = [tok.encode(t, add_special_tokens=False).ids for t in texts]
    prompt = tok.encode("Hello", add_special_tokens=False).ids
    one = [IncrementalDetokenizer(tok, prompt) for _ in texts]
    bulk = [IncrementalDetokenizer(tok, prompt) for _ in texts]
    for step in range(max(map(len, streams))):
        live = [i for i, s in enumerate(streams) if step < len(s)]
        expected = [one[i].append(streams[i][step]) for i in live]
        assert append_tokens([bulk[i] for i in live], [streams[i][step] for i in live]) == expected
    assert [d.text for d in bulk] == [d.text for d in one] == texts


class _Failing:
    """A tokenizer whose decode raises from the ``fail_at``-th call on."""

    def __init__(self, tok, fail_at: int):
        self.tok, self.calls, self.fail_at = tok, 0, fail_at

    def decode(self, ids, skip_special_tokens=True):
        self.calls += 1
        if self.calls >= self.fail_at:
            raise RuntimeError("decode broke")
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


def test_append_tokens_changes_nothing_when_a_decode_raises():
    tok = build_tokenizer()
    ids = tok.encode("hello world", add_special_tokens=False).ids
    for fail_at in (4, 5):  # the window's decode, then the new prefix's
        failing = _Failing(tok, fail_at)
        d = IncrementalDetokenizer(failing, ids[:2])  # decode 1: the prompt's context
        d.append(ids[2])  # decodes 2 and 3: the window, then the emitted text's prefix
        before = (list(d._ids), d._read_offset, d._prefix_text, d.text)
        try:
            append_tokens([d], [ids[3]])
        except RuntimeError:
            pass
        else:
            raise AssertionError("append_tokens swallowed the error")
        assert failing.calls == fail_at
        assert (d._ids, d._read_offset, d._prefix_text, d.text) == before


def test_check_stop_refuses_a_bulk_text_for_a_stop_token():
    tok = build_tokenizer()
    params = SamplingParams(stop_token_ids=[9])
    assert is_stop_token(1, 9, params, [2]) and is_stop_token(1, 2, params, [2])
    assert not is_stop_token(1, 5, params, [2])
    assert not is_stop_token(1, 2, SamplingParams(ignore_eos=True), [2])
    assert not is_stop_token(1, 2, SamplingParams(min_tokens=1), [2])
    detok = IncrementalDetokenizer(tok, [5, 6])
    try:
        check_stop([9], 9, params, [2], detok, new_text="x")
    except ValueError as e:
        assert "new_text" in str(e)
    else:
        raise AssertionError("a stop token's bulk text was accepted")


def test_engine_texts_match_decoding_the_tokens(engine_factory):
    """Rows detokenised in bulk (n = 1) and one by one (n = 2, stop tokens) give the same text as
    decoding the tokens, and stop strings still cut it."""
    engine = engine_factory(max_num_seqs=32)
    tok = engine.tokenizer
    for i in range(8):
        engine.add_request(f"a{i}", prompt_token_ids=list(range(10 + i, 30 + i)),
                           sampling_params=SamplingParams(temperature=1.0, seed=i, max_tokens=24,
                                                          ignore_eos=True))
    engine.add_request("n2", prompt_token_ids=[5, 6, 7],
                       sampling_params=SamplingParams(temperature=1.0, seed=3, n=2, max_tokens=16))
    engine.add_request("g", prompt_token_ids=[40, 41, 42],
                       sampling_params=SamplingParams(temperature=0, max_tokens=30))
    finals = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    for rid, out in finals.items():
        for c in out.outputs:
            ids = c.token_ids[:-1] if c.finish_reason == "stop" else c.token_ids
            assert c.text == tok.decode(ids), rid
    # a stop string taken from a bulk-detokenised completion's text cuts the same request rerun
    text = finals["a3"].outputs[0].text
    assert len(text) > 6
    stop = text[3:6]
    again = engine_factory()
    again.add_request("a3", prompt_token_ids=list(range(13, 33)),
                      sampling_params=SamplingParams(temperature=1.0, seed=3, max_tokens=24, ignore_eos=True,
                                                     stop=[stop]))
    while again.has_unfinished():
        for out in again.step():
            if out.finished:
                assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop
                assert out.outputs[0].text == text[:text.index(stop)]


def _run_all(engine, requests, abort_after: dict[str, int] | None = None) -> dict:
    """Run ``requests`` ({id: (prompt ids, SamplingParams)}) to the end; {id: final RequestOutput}.
    ``abort_after``: {id: step} aborts that request after that many steps."""
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt_token_ids=prompt, sampling_params=params)
    finals, steps = {}, 0
    while engine.has_unfinished():
        steps += 1
        for rid, at in (abort_after or {}).items():
            if at == steps:
                engine.abort(rid)
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    for out in engine.step():  # an abort's output comes with the next step
        finals[out.request_id] = out
    return finals


def test_final_only_texts_decoded_once_equal_the_step_by_step_texts(engine_factory):
    """A final-only completion without stop strings is detokenised once, when its output is built;
    its text is the one the step-by-step detokeniser gives, whatever ended it."""
    import dataclasses

    base = {
        "length": ([5, 6, 7, 8], SamplingParams(temperature=1.0, seed=1, max_tokens=40, ignore_eos=True)),
        "eos": ([9, 10], SamplingParams(temperature=1.0, seed=2, max_tokens=60)),
        "eos_kept": ([9, 10], SamplingParams(temperature=1.0, seed=2, max_tokens=60,
                                             include_stop_str_in_output=True, skip_special_tokens=False)),
        "stop_id": ([11, 12], SamplingParams(temperature=1.0, seed=3, max_tokens=60,
                                             stop_token_ids=[40, 41, 42])),
        "n2": ([5, 6, 7], SamplingParams(temperature=1.0, seed=4, n=2, max_tokens=30)),
        "greedy": ([40, 41, 42], SamplingParams(temperature=0, max_tokens=30)),
        "aborted": ([20, 21], SamplingParams(temperature=1.0, seed=5, max_tokens=50, ignore_eos=True)),
        "stop_str": ([7, 8], SamplingParams(temperature=1.0, seed=6, max_tokens=30, stop=["e"])),
    }
    final_only = {rid: (p, dataclasses.replace(sp, output_kind="final_only"))
                  for rid, (p, sp) in base.items()}
    eager = _run_all(engine_factory(max_num_seqs=32), base, {"aborted": 6})
    engine = engine_factory(max_num_seqs=32)
    deferred = _run_all(engine, final_only, {"aborted": 6})
    assert set(eager) == set(deferred) == set(base)
    reasons = set()
    for rid in base:
        for a, b in zip(eager[rid].outputs, deferred[rid].outputs, strict=True):
            assert (a.token_ids, a.finish_reason, a.stop_reason) == \
                (b.token_ids, b.finish_reason, b.stop_reason)
            assert a.text == b.text, rid
            reasons.add(a.finish_reason)
    assert {"length", "stop", "abort"} <= reasons
    assert eager["length"].outputs[0].text  # texts were produced at all
    # stop strings need the text every step: such a request is detokenised as it runs
    assert all(seq.deferred_text is None for r in engine.requests.values() for seq in r.seqs)
    req = engine.make_request("x", prompt_token_ids=[1, 2], sampling_params=final_only["stop_str"][1])
    assert req.seqs[0].detokenizer is not None and req.seqs[0].deferred_text is None
    req = engine.make_request("y", prompt_token_ids=[1, 2], sampling_params=final_only["length"][1])
    assert req.seqs[0].detokenizer is None and req.seqs[0].deferred_text is not None
