"""Speculative decoding in the engine (workers/spec/decoder.py and the engine's verify step): every
method gives the tokens decoding without it gives (greedy, seeded, unseeded in distribution), over
chunked prefill, preemption, prefix hits, stops, logprobs and LoRA-free mixes; rejected drafts leave
the block pool as it was; the switches (per request, by batch size) turn it off."""

from __future__ import annotations

import pytest
from test_structured_engine import run  # step until idle: each request's final output

from batchinfer.workers.engine.engine import Engine
from batchinfer.workers.sampling_params import SamplingParams

# Prompts that repeat themselves, as extraction and rewriting do: prompt lookup finds drafts there.
PROMPTS = [
    [5, 6, 7, 8, 9, 10, 11, 12] * 4,
    list(range(40, 70)) + list(range(40, 55)),
    [100, 101, 102, 100, 101, 102, 100, 101, 102, 103, 104],
    list(range(200, 260)),
]
# Prompts whose greedy outputs on the tiny model loop (tests/test_spec_combos.py found them):
# the drafts of every method are accepted there.
LOOPS = [[300, 301] * 10, [120] * 5 + [121] * 5, [7] * 20, [1, 2, 3] * 8]
METHODS = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3},
    "suffix": {"method": "suffix", "num_speculative_tokens": 4},
}


def completions(engine: Engine, params: SamplingParams, prompts=PROMPTS, **kwargs) -> dict[str, tuple]:
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", prompt_token_ids=p, sampling_params=params, **kwargs)
    return {rid: tuple((c.token_ids, c.text, c.finish_reason) for c in out.outputs)
            for rid, out in run(engine).items()}


def accepted(engine: Engine) -> int:
    return sum(m["accepted_tokens"] for m in engine.spec_stats()["methods"].values())


GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


@pytest.mark.parametrize("method", sorted(METHODS))
def test_greedy_tokens_are_the_same_with_and_without_speculation(engine_factory, method):
    prompts = PROMPTS + LOOPS
    want = completions(engine_factory(), GREEDY, prompts=prompts)
    engine = engine_factory(speculative_config=dict(METHODS[method], disable_by_batch_size=None))
    assert completions(engine, GREEDY, prompts=prompts) == want
    stats = engine.spec_stats()
    assert stats["methods"][method]["draft_tokens"] > 0 and accepted(engine) >= 20, stats
    assert engine.kv_usage == 0.0  # every block came back


def test_a_prediction_drafts_for_its_request_and_changes_nothing(engine_factory):
    ref_engine = engine_factory()
    want = completions(ref_engine, GREEDY)
    text = {rid: out[0][1] for rid, out in want.items()}
    engine = engine_factory()  # no speculative_config: a request's own prediction still drafts
    for i, p in enumerate(PROMPTS):
        # the right answer for half of them, a wrong one for the others
        prediction = text[f"r{i}"] if i % 2 == 0 else "something else entirely, " * 3
        engine.add_request(f"r{i}", prompt_token_ids=p,
                           sampling_params=SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True,
                                                          prediction=prediction))
    outs = run(engine)
    got = {rid: tuple((c.token_ids, c.text, c.finish_reason) for c in out.outputs)
           for rid, out in outs.items()}
    assert got == want
    stats = engine.spec_stats()["methods"]["prediction"]
    # each completion's share, as OpenAI's usage reports it
    usage = [(o.outputs[0].accepted_prediction_tokens, o.outputs[0].rejected_prediction_tokens)
             for o in outs.values()]
    assert sum(a for a, _ in usage) == stats["accepted_tokens"]
    assert sum(a + r for a, r in usage) == stats["draft_tokens"]
    assert outs["r0"].outputs[0].accepted_prediction_tokens > 0
    assert all(o.outputs[0].accepted_prediction_tokens is None for o in run_plain(engine_factory()))
    # a right prediction is accepted where its text tokenises as the output did (a random model's
    # bytes are not always valid UTF-8): fewer steps than without it
    assert stats["accepted_tokens"] >= 20, stats
    alone = engine_factory()  # the first request alone: its prediction saves steps
    alone.add_request("r0", prompt_token_ids=PROMPTS[0], sampling_params=SamplingParams(
        temperature=0.0, max_tokens=40, ignore_eos=True, prediction=text["r0"]))
    assert run(alone)["r0"].outputs[0].token_ids == want["r0"][0][0]
    assert alone.num_steps < 40 - 10


def run_plain(engine: Engine) -> list:
    engine.add_request("plain", prompt_token_ids=PROMPTS[0], sampling_params=GREEDY)
    return list(run(engine).values())


def test_seeded_sampling_gives_the_same_tokens_with_speculation(engine_factory):
    params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=30, ignore_eos=True, seed=7, n=2,
                            repetition_penalty=1.1, frequency_penalty=0.2)
    want = completions(engine_factory(), params)
    engine = engine_factory(speculative_config=dict(METHODS["ngram"], disable_by_batch_size=None))
    assert completions(engine, params) == want
    assert engine.spec_stats()["methods"]["ngram"]["draft_tokens"] > 0


def test_unseeded_sampling_keeps_the_target_distribution(engine_factory):
    """Two-sample chi-square: the third token of 400 unseeded completions of one prompt, with and
    without drafts; the drafts (a prediction of the most likely continuation) are often accepted."""
    scipy_stats = pytest.importorskip("scipy.stats")
    prompt = [5, 6, 7, 8, 9, 10, 11, 12] * 3
    greedy = completions(engine_factory(), SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True),
                         prompts=[prompt])["r0"][0][1]
    params = SamplingParams(temperature=0.7, max_tokens=3, ignore_eos=True, prediction=greedy)
    counts = []
    for seed, spec in ((1, {"use_predictions": False}), (2, {"disable_by_batch_size": None})):
        engine = engine_factory(seed=seed, speculative_config=spec)
        outs = completions(engine, params, prompts=[prompt] * 400)
        counts.append([out[0][0][2] for out in outs.values()])
        if spec.get("use_predictions") is not False:
            assert engine.spec_stats()["methods"]["prediction"]["accepted_tokens"] > 200
    tokens = sorted(set(counts[0]) | set(counts[1]))
    table = [[c.count(t) for t in tokens] for c in counts]
    # bins with few samples pooled, as the test needs expected counts of 5 or more
    keep = [j for j in range(len(tokens)) if table[0][j] + table[1][j] >= 20]
    pooled = [[row[j] for j in keep] + [sum(row) - sum(row[j] for j in keep)] for row in table]
    columns = [c for c in zip(*pooled, strict=True) if sum(c) > 0]  # the pool may be empty
    pooled = [list(row) for row in zip(*columns, strict=True)]
    assert len(pooled[0]) >= 3  # a real distribution, not one token
    p = scipy_stats.chi2_contingency(pooled).pvalue
    assert p > 0.001, (p, pooled)


def test_speculation_over_chunked_prefill_preemption_and_prefix_hits(engine_factory):
    # 8 tokens a step and a pool too small for all: chunks, preemptions; shared prefixes: hits
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12] * 3 + [i] for i in range(6)]
    config = {"max_num_batched_tokens": 8, "num_kv_blocks": 14, "block_size": 4}
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    want = completions(engine_factory(**config), params, prompts=prompts)
    engine = engine_factory(**config, speculative_config=dict(METHODS["ngram"], disable_by_batch_size=None))
    assert completions(engine, params, prompts=prompts) == want
    assert engine.num_preemptions > 0 and engine.prefix_hit_rate > 0
    assert accepted(engine) > 0 and engine.kv_usage == 0.0


def test_stops_max_tokens_and_logprobs_hold_with_drafts(engine_factory):
    ref = engine_factory()
    base = completions(ref, GREEDY, prompts=PROMPTS[:1])["r0"][0]
    stop_text = base[1][12:15]
    # the right prediction, so that drafts are accepted up to the stop string and cut there
    params = SamplingParams(temperature=0.0, max_tokens=25, stop=[stop_text], logprobs=2, prediction=base[1])
    want = run_with_logprobs(engine_factory(speculative_config={"use_predictions": False}), params)
    engine = engine_factory(speculative_config=dict(METHODS["ngram"], disable_by_batch_size=None))
    got = run_with_logprobs(engine, params)
    assert [g[:3] for g in got] == [w[:3] for w in want]
    assert got[0][2] == "stop"
    for g, w in zip(got, want, strict=True):  # the same distributions, read off a longer forward
        assert len(g[3]) == len(w[3])
        for a, b in zip(g[3], w[3], strict=True):
            assert a.keys() == b.keys()
            assert all(abs(a[t].logprob - b[t].logprob) < 1e-4 for t in a)
    assert accepted(engine) > 0


def run_with_logprobs(engine: Engine, params: SamplingParams) -> list[tuple]:
    engine.add_request("l", prompt_token_ids=PROMPTS[0], sampling_params=params)
    out = run(engine)["l"].outputs[0]
    return [(out.token_ids, out.text, out.finish_reason, out.logprobs)]


def test_rejected_drafts_leave_the_block_pool_as_it_was(engine_factory):
    """One step with drafts that are all wrong: the sequence's blocks and the free pool are what a
    step without drafts leaves (the draft slots' blocks freed, nothing registered from them)."""
    prompt = list(range(1, 16))  # 15 tokens: the next blocks hold the draft positions
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    plain = engine_factory(block_size=4, speculative_config={"use_predictions": False})
    t1, t2 = completions(engine_factory(), params, prompts=[prompt])["r0"][0][0][:2]
    tok = plain.tokenizer
    wrong = next(c for c in "zqxj" if tok.encode(c, add_special_tokens=False) != [t2])
    # the first output token as predicted, then 7 wrong ones: all rejected at the first draft
    prediction = tok.decode([t1]) + wrong * 7
    spec = engine_factory(block_size=4, speculative_config={"num_speculative_tokens": 7,
                                                            "disable_by_batch_size": None})
    plain.add_request("a", prompt_token_ids=prompt, sampling_params=params)
    spec.add_request("a", prompt_token_ids=prompt,
                     sampling_params=SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True,
                                                    prediction=prediction))
    for e in (plain, spec):
        e.step()  # the prefill and the first token
        e.step()  # one decode step: the spec engine's with 7 drafts
    mine, theirs = spec.requests["a"].seqs[0], plain.requests["a"].seqs[0]
    stats = spec.spec_stats()["methods"]["prediction"]
    assert stats == {"drafts": 1, "draft_tokens": 7, "accepted_tokens": 0}
    assert mine.output_token_ids == theirs.output_token_ids == [t1, t2]
    assert mine.num_computed_tokens == theirs.num_computed_tokens
    assert mine.block_table == theirs.block_table  # the same blocks, taken in the same order
    assert spec.block_manager.num_free_blocks == plain.block_manager.num_free_blocks
    assert spec.block_manager.cached == plain.block_manager.cached


def test_the_switches_turn_it_off(engine_factory):
    config = dict(METHODS["ngram"], disable_by_batch_size=2)
    engine = engine_factory(speculative_config=config)
    completions(engine, GREEDY)  # 4 running > 2: off until two have finished
    stats = engine.spec_stats()
    assert stats["disabled_steps"] > 0
    off = engine_factory(speculative_config=dict(config, disable_by_batch_size=None))
    opted_out = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, speculative=False)
    off.add_request("out", prompt_token_ids=LOOPS[0], sampling_params=opted_out)
    off.add_request("in", prompt_token_ids=LOOPS[0], sampling_params=GREEDY)
    seqs = {rid: off.requests[rid].seqs[0] for rid in ("out", "in")}  # finished requests leave the table
    run(off)
    assert seqs["out"].num_draft_tokens == 0 and seqs["in"].num_draft_tokens > 0
    assert off.spec_stats()["methods"]["ngram"]["drafts"] > 0


TWO_FIELDS = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 24},
                                               "b": {"type": "string", "maxLength": 24}},
              "required": ["a", "b"], "additionalProperties": False}


@pytest.mark.parametrize("backend", ["llguidance", "xgrammar"])
@pytest.mark.parametrize("constraint", [{"regex": "[a-z]{2,8}( [a-z]{2,8}){3,6}"}, {"json": TWO_FIELDS}],
                         ids=["regex", "json"])
def test_a_constrained_completion_verifies_the_drafts_its_grammar_allows(engine_factory, backend, constraint):
    """Predictions of the right text (drafts the grammar accepts, through forced JSON keys that
    jump-forward appends) and of text the grammar refuses (cut to nothing): the same tokens as
    without speculation, with drafts verified for the first kind."""
    if backend == "xgrammar":
        pytest.importorskip("xgrammar")
    config = {"structured_outputs_backend": backend}

    def params(prediction=None, logprobs=None):
        return SamplingParams(temperature=0.0, max_tokens=60, structured_outputs=constraint,
                              prediction=prediction, logprobs=logprobs)

    prompts = PROMPTS[:3]
    want = completions(engine_factory(**config, speculative_config={"use_predictions": False}), params(),
                       prompts=prompts)
    engine = engine_factory(**config, speculative_config={"num_speculative_tokens": 6,
                                                          "disable_by_batch_size": None})
    for i, p in enumerate(prompts):
        right = want[f"r{i}"][0][1]
        prediction = right if i != 1 else right.upper() + " NOT ALLOWED {"
        engine.add_request(f"r{i}", prompt_token_ids=p, sampling_params=params(prediction))
    got = {rid: tuple((c.token_ids, c.text, c.finish_reason) for c in out.outputs)
           for rid, out in run(engine).items()}
    assert got == want
    stats = engine.spec_stats()["methods"]["prediction"]
    assert stats["accepted_tokens"] > 0, stats
    # with logprobs (no jump-forward: each forced token is a sampled one) the same tokens too
    logprob_engine = engine_factory(**config, speculative_config={"disable_by_batch_size": None})
    logprob_engine.add_request("r0", prompt_token_ids=prompts[0],
                               sampling_params=params(want["r0"][0][1], logprobs=1))
    assert run(logprob_engine)["r0"].outputs[0].token_ids == want["r0"][0][0]
    assert accepted(logprob_engine) > 0
