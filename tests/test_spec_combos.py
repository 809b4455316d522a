"""Speculative decoding combined with the engine's other features: a draft model (the target itself,
another model; greedy and seeded), LoRA adapters mixed in one batch, tensor parallelism (TP=2 on
the CPU), structured outputs next to free requests, n > 1 next to a request that opts out, and the
real SmolLM2 (slow). Each gives the tokens decoding without speculation gives, and each checks that
drafts were really verified (or, where they must not be, that none were)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from test_spec_engine import LOOPS, completions, run

from batchinfer.workers.engine.engine import Engine
from batchinfer.workers.engine.sequence import Request
from batchinfer.workers.engine_config import EngineConfig
from batchinfer.workers.models.tiny import make_tiny_model
from batchinfer.workers.sampling_params import SamplingParams

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
         "disable_by_batch_size": None}
GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=30, ignore_eos=True, seed=7, n=2)
# Prompts whose greedy continuations on the tiny Llama fall into loops, so that prompt lookup's drafts
# are accepted (PROMPTS' continuations rarely repeat: few of their drafts are).


def draft_config(model: Path) -> dict[str, Any]:
    return {"method": "draft", "model": str(model), "num_speculative_tokens": 4,
            "disable_by_batch_size": None}


def method_stats(engine: Engine, method: str) -> dict[str, int]:
    return engine.spec_stats()["methods"][method]


Jobs = dict[str, tuple[list[int], SamplingParams, dict[str, Any]]]


def submit(engine: Engine, jobs: Jobs) -> dict[str, Request]:
    """Queue ``jobs`` (request id -> (prompt, params, add_request keywords)); their requests, kept
    so that their sequences' draft counters can be read after they finish."""
    for rid, (prompt, params, kwargs) in jobs.items():
        engine.add_request(rid, prompt_token_ids=prompt, sampling_params=params, **kwargs)
    return {rid: engine.requests[rid] for rid in jobs}


def outputs(engine: Engine) -> dict[str, tuple]:
    """Step until idle: every request's completions as (token ids, text, finish reason)."""
    return {rid: tuple((c.token_ids, c.text, c.finish_reason) for c in out.outputs)
            for rid, out in run(engine).items()}


# -- a draft model ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def other_draft(tmp_path_factory) -> Path:
    """A draft with the target's tokenizer and shapes, other weights."""
    return make_tiny_model(tmp_path_factory.mktemp("combo-draft") / "tiny-llama-seed1", seed=1)


def test_a_draft_model_gives_the_greedy_tokens_and_the_target_as_draft_is_accepted(
        engine_factory, tiny_llama, other_draft):
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    want = completions(engine_factory(), params)
    rates = {}
    for name, model in (("self", tiny_llama), ("other", other_draft)):
        engine = engine_factory(speculative_config=draft_config(model))
        assert completions(engine, params) == want, name
        stats = method_stats(engine, "draft")
        assert stats["draft_tokens"] > 0, (name, stats)
        rates[name] = stats["accepted_tokens"] / stats["draft_tokens"]
        # both KV pools are empty again: the target's and the draft's (its shadows released)
        draft = engine.spec.proposers["draft"]
        assert engine.kv_usage == 0.0 and draft.block_manager.num_free_blocks == draft.runner.num_blocks
    # the target drafting for itself guesses its own greedy tokens: (nearly) all accepted
    assert rates["self"] >= 0.9, rates
    assert rates["other"] < rates["self"] - 0.3, rates


def test_seeded_sampling_with_a_draft_model_gives_the_same_tokens(engine_factory, tiny_llama):
    want = completions(engine_factory(), SEEDED)
    engine = engine_factory(speculative_config=draft_config(tiny_llama))
    assert completions(engine, SEEDED) == want
    stats = method_stats(engine, "draft")
    assert stats["draft_tokens"] > 0 and stats["accepted_tokens"] > 0, stats


# -- LoRA ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def lora_case(tmp_path_factory) -> dict[str, Any]:
    """The tiny Llama with two PEFT adapters, loaded once."""
    pytest.importorskip("peft")
    from lora_cases import make_base, make_peft_adapter

    root = tmp_path_factory.mktemp("combo-lora")
    base = make_base(root / "base")
    a0 = make_peft_adapter(base, root / "a0", r=8, alpha=16, seed=1)
    a1 = make_peft_adapter(base, root / "a1", r=4, alpha=8, seed=2, targets=("q_proj", "v_proj"))
    loaded = Engine(EngineConfig(model=str(base), num_kv_blocks=4))
    return {"base": base, "adapters": {"a0": str(a0), "a1": str(a1)}, "model": loaded.model,
            "tokenizer": loaded.tokenizer}


def test_lora_adapters_and_the_base_mixed_with_ngram_drafts(lora_case):
    def engine(**config: Any) -> Engine:
        cfg = EngineConfig(model=str(lora_case["base"]), lora_modules=lora_case["adapters"], max_loras=2,
                           num_kv_blocks=64, **config)
        return Engine(cfg, model=lora_case["model"], tokenizer=lora_case["tokenizer"])

    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    jobs = {f"{name}/{i}": (p, params, {"lora": name})
            for i, p in enumerate(LOOPS) for name in (None, "a0", "a1")}
    ref = engine()
    submit(ref, jobs)
    want = outputs(ref)
    spec = engine(speculative_config=NGRAM)
    reqs = submit(spec, jobs)
    assert outputs(spec) == want
    # the adapters change the tokens (else this would not test that drafts run under them)
    assert want["a0/0"] != want["None/0"] and want["a1/0"] != want["None/0"]
    # drafts were verified and accepted under each adapter and the base model
    kept = {name: sum(r.seqs[0].num_accepted_tokens for r in reqs.values() if r.lora == name)
            for name in (None, "a0", "a1")}
    assert all(n > 0 for n in kept.values()), kept
    assert spec.kv_usage == 0.0


# -- tensor parallelism -------------------------------------------------------------------------


def test_tp2_with_ngram_gives_the_tp1_greedy_tokens(tiny_llama):
    want = completions(Engine(EngineConfig(model=str(tiny_llama), num_kv_blocks=64)), GREEDY, prompts=LOOPS)
    engine = Engine(EngineConfig(model=str(tiny_llama), num_kv_blocks=64, tensor_parallel_size=2,
                                 speculative_config=NGRAM))
    try:
        assert engine.model.tp is not None and engine.model.tp.size == 2
        got = completions(engine, GREEDY, prompts=LOOPS)
        assert engine.kv_usage == 0.0
    finally:
        engine.close()
    assert got == want
    assert method_stats(engine, "ngram")["accepted_tokens"] >= 10, engine.spec_stats()


# -- structured outputs -------------------------------------------------------------------------

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 130}},
          "required": ["name", "age"], "additionalProperties": False}


def test_constrained_requests_keep_their_tokens_next_to_free_ones_with_drafts(engine_factory):
    """A constrained completion drafts only what its grammar accepts (``cut_drafts``), and its draft
    rows are masked in the grammar's state after the drafts before them: greedy and seeded JSON
    next to free requests give the tokens of decoding without drafts."""
    constrained = {"max_tokens": 60, "structured_outputs": {"json": PERSON}}
    jobs = {f"free{i}": (p, GREEDY, {}) for i, p in enumerate(LOOPS)}
    jobs["json"] = (LOOPS[0], SamplingParams(temperature=0.0, **constrained), {})
    jobs["json-seeded"] = (LOOPS[1], SamplingParams(temperature=0.8, seed=11, **constrained), {})
    # a prediction the grammar accepts but the model does not write: its drafts are rejected part way
    jobs["json-wrong"] = (LOOPS[2], SamplingParams(temperature=0.0, prediction='{"name":"Bob","age":7}',
                                                   **constrained), {})
    ref = engine_factory()
    submit(ref, jobs)
    want = outputs(ref)
    for rid in ("json", "json-seeded", "json-wrong"):
        assert set(json.loads(want[rid][0][1])) == {"name", "age"}, want[rid]  # the constraint held
        if rid == "json-wrong":
            continue
        # their exact outputs as predictions: drafts that run through the grammar's states
        params = jobs[rid][1]
        jobs[rid] = (jobs[rid][0], SamplingParams(temperature=params.temperature, seed=params.seed,
                                                  prediction=want[rid][0][1], **constrained), {})
    engine = engine_factory(speculative_config=NGRAM)
    reqs = submit(engine, jobs)
    assert outputs(engine) == want
    for rid in ("json", "json-seeded"):
        assert reqs[rid].seqs[0].num_accepted_tokens > 0, rid
    assert all(reqs[f"free{i}"].seqs[0].num_draft_tokens > 0 for i in range(len(LOOPS)))
    stats = engine.spec_stats()["methods"]
    assert stats["ngram"]["accepted_tokens"] > 0 and stats["prediction"]["accepted_tokens"] > 0, stats


# -- n > 1 and a request that opts out -----------------------------------------------------------


def test_n_siblings_speculate_and_an_opted_out_request_never_drafts(engine_factory):
    opt_out = SamplingParams(temperature=0.8, max_tokens=30, ignore_eos=True, seed=3, n=2, speculative=False)
    greedy_n = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, n=3)
    jobs = {"seeded": (LOOPS[0], SEEDED, {}), "greedy": (LOOPS[1], greedy_n, {}),
            "out": (LOOPS[2], opt_out, {}), "free": (LOOPS[3], GREEDY, {})}
    ref = engine_factory()
    submit(ref, jobs)
    want = outputs(ref)
    engine = engine_factory(speculative_config=NGRAM)
    reqs = submit(engine, jobs)
    assert outputs(engine) == want
    assert len(want["seeded"]) == 2 and len(want["greedy"]) == 3 and len(want["out"]) == 2
    assert want["seeded"][0] != want["seeded"][1]  # seeded siblings draw their own tokens
    assert [s.num_draft_tokens for s in reqs["out"].seqs] == [0, 0]
    for rid in ("seeded", "greedy"):
        assert all(s.num_draft_tokens > 0 for s in reqs[rid].seqs), rid
    assert sum(s.num_accepted_tokens for s in reqs["greedy"].seqs) > 0


# -- real weights -------------------------------------------------------------------------------

QUOTES = [
    "Repeat this sentence exactly: The quick brown fox jumps over the lazy dog near the river bank, "
    "then it runs back into the dark green forest to find its family.",
    "Copy the following list word for word: apples, oranges, bananas, grapes, pears, plums, cherries, "
    "lemons, limes, peaches, mangoes, melons, kiwis, figs, dates.",
    "Repeat this sentence exactly: Batch inference runs many requests together on one machine, which "
    "keeps the accelerator busy and lowers the cost of every answer.",
]


@pytest.fixture(scope="module")
def smollm2() -> Engine:
    from batchinfer.workers.models.demo import demo_gguf

    try:
        path = demo_gguf()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    return Engine(EngineConfig(model=str(path), max_model_len=512, num_kv_blocks=32))


@pytest.mark.slow
def test_smollm2_quoting_its_input_gives_the_same_tokens_with_ngram_and_suffix(smollm2):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # 2 shared cores: OpenMP barriers with a descheduled sibling are slow
    try:
        tok = smollm2.tokenizer
        prompts = [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=True) for q in QUOTES]
        # up to 48 tokens, ending at EOS: past it the model rambles, and only the quote is a test
        # of drafting (the tokens are compared either way)
        params = SamplingParams(temperature=0.0, max_tokens=48)

        def engine(spec: dict[str, Any] | None) -> Engine:
            cfg = EngineConfig(model=smollm2.config.model, max_model_len=512, num_kv_blocks=64,
                               speculative_config=spec)
            return Engine(cfg, model=smollm2.model, tokenizer=tok)

        want = completions(engine(None), params, prompts=prompts)
        ngram = engine(NGRAM)
        assert completions(ngram, params, prompts=prompts) == want
        suffix = engine({"method": "suffix", "num_speculative_tokens": 4, "disable_by_batch_size": None})
        assert completions(suffix, params, prompts=prompts) == want
    finally:
        torch.set_num_threads(threads)
    stats = method_stats(ngram, "ngram")
    assert stats["accepted_tokens"] / stats["draft_tokens"] > 0.3, stats
    assert method_stats(suffix, "suffix")["accepted_tokens"] > 0
    assert "quick brown fox" in want["r0"][0][1]  # the model does quote: drafts had something to find
