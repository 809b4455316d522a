"""Structured outputs through the engine on a tiny random model (vocab 320, byte-level BPE).

The model's free output is noise, so only the constraint makes an output valid: every output of a
256-request job over the cases of ``structured_cases`` must end by itself ("stop") and pass its
check (``jsonschema`` with the format checker for JSON), greedy and sampled, with chunked prefill
and preemption. Then: free rows are untouched by constrained ones, jump-forward changes no token,
the finish reasons, compile errors, the compile cache, n > 1, and a matcher failing mid-way.
"""

from __future__ import annotations

import copy

import pytest
import torch
from structured_cases import GRAMMAR_CASES, JSON_SCHEMAS, UNBOUNDED, all_cases, check_output

from batchinfer.workers.engine.engine import Engine
from batchinfer.workers.sampling_params import SamplingParams
from batchinfer.workers.structured.bitmask import apply_bitmask, unpack_bitmask
from batchinfer.workers.structured_params import StructuredLimits, StructuredOutputsParams

CASES = all_cases()
PERSON = StructuredOutputsParams(json=JSON_SCHEMAS["extraction"])


@pytest.fixture(scope="module")
def engine_factory(engine_factory):
    """conftest's factory with room for 256 requests' KV blocks by default."""
    return lambda **config: engine_factory(**{"num_kv_blocks": 256, **config})


def run(engine: Engine) -> dict:
    """Step until idle; the final output of every request, by id."""
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return done


def record_steps(engine: Engine) -> list:
    """Spy on the real scheduler: (tokens run, samples, output tokens so far) of every sequence it
    plans, in order."""
    planned: list = []
    schedule = engine.scheduler.schedule

    def recording():
        plan = schedule()
        planned.extend((s.num_new_tokens, s.samples, s.seq.num_output_tokens) for s in plan.scheduled)
        return plan

    engine.scheduler.schedule = recording  # type: ignore[method-assign]
    return planned


def prompt(i: int) -> str:
    return f"Document {i}: extract the fields{'!' * (i % 5)}"


def add_job(engine: Engine, sampled: bool, n_requests: int = 256, max_tokens: int = 250) -> list:
    """One request per row, cycling through CASES; returns each row's params."""
    rows = []
    for i in range(n_requests):
        case = CASES[i % len(CASES)]
        mode = dict(temperature=1.0, top_p=0.95, seed=i) if sampled else dict(temperature=0.0)
        params = SamplingParams(max_tokens=max_tokens, structured_outputs=case.params, **mode)
        engine.add_request(f"r{i}", prompt=prompt(i), sampling_params=params)
        rows.append(params)
    return rows


def test_the_cases_cover_what_the_issue_asks_for():
    assert len(JSON_SCHEMAS) >= 25 and UNBOUNDED.issubset(JSON_SCHEMAS)
    kinds = {c.params.kind for c in CASES}
    assert kinds == {"json", "regex", "choice", "grammar"}
    grammars = [g for g, _ in GRAMMAR_CASES.values()]
    assert any("::=" in g for g in grammars) and any("start:" in g for g in grammars)  # EBNF and Lark
    text = repr(JSON_SCHEMAS)
    for keyword in ("minItems", "maxItems", "enum", "const", "minimum", "pattern", "format", "anyOf",
                    "$ref", "$defs", "required", "multipleOf", "prefixItems"):
        assert keyword in text, keyword


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_every_output_of_a_256_request_job_is_complete_and_valid(engine_factory, sampled):
    # 64 tokens a step chunks the prompts; 24 blocks of 16 tokens hold ~10 sequences: preemption.
    engine = engine_factory(num_kv_blocks=24, max_num_batched_tokens=64)
    planned = record_steps(engine)
    rows = add_job(engine, sampled)
    done = run(engine)
    assert engine.num_preemptions > 0
    assert any(not samples for _, samples, _ in planned)  # a prompt or a recompute ran in several chunks
    for i, params in enumerate(rows):
        out = done[f"r{i}"].outputs[0]
        where = f"r{i} ({CASES[i % len(CASES)].name})"
        assert out.finish_reason == "stop" and out.stop_reason is None, (where, out.finish_reason, out.text)
        assert out.structured == params.structured_outputs.kind and out.structured_complete is True, where
        check_output(params.structured_outputs, out.text)
    assert len({done[f"r{i}"].outputs[0].text for i in range(256)}) > len(CASES)  # not one answer per case
    stats = engine.structured.stats()
    assert stats["num_compiles"] == len(CASES) and stats["num_rows_filled"] > 0
    assert stats["num_jump_forward_tokens"] > 0 and engine.block_manager.num_free_blocks == 24


def test_free_rows_are_token_identical_with_and_without_constrained_rows(engine_factory):
    free = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
            SamplingParams(temperature=1.0, top_p=0.9, seed=5, max_tokens=12, ignore_eos=True),
            SamplingParams(temperature=0.7, top_k=20, seed=6, max_tokens=12, ignore_eos=True)]
    alone = engine_factory()
    for i, params in enumerate(free):
        alone.add_request(f"f{i}", prompt=prompt(i), sampling_params=params)
    ref = run(alone)
    mixed = engine_factory()
    for i, case in enumerate(CASES[:12]):
        mixed.add_request(f"c{i}", prompt=prompt(100 + i), sampling_params=SamplingParams(
            temperature=1.0, seed=i, max_tokens=200, structured_outputs=case.params))
    for i, params in enumerate(free):
        mixed.add_request(f"f{i}", prompt=prompt(i), sampling_params=params)
    got = run(mixed)
    assert mixed.structured.stats()["num_rows_filled"] > 0
    for i in range(len(free)):
        out = got[f"f{i}"].outputs[0]
        assert out.token_ids == ref[f"f{i}"].outputs[0].token_ids
        assert out.structured is None and out.structured_complete is None


def test_jump_forward_on_and_off_give_the_same_greedy_tokens(engine_factory):
    outs, engines, chunks = {}, {}, {}
    for jump in (True, False):
        engine = engines[jump] = engine_factory(jump_forward=jump)
        planned = record_steps(engine)
        add_job(engine, sampled=False, n_requests=2 * len(CASES))
        outs[jump] = {rid: o.outputs[0].token_ids for rid, o in run(engine).items()}
        # Decode steps that ran more than the one sampled token: the jumped tokens, as one chunk.
        chunks[jump] = [n for n, _, generated in planned if generated and n > 1]
    assert outs[True] == outs[False]
    assert chunks[True] and not chunks[False] and engines[True].num_preemptions == 0
    on, off = engines[True].structured.stats(), engines[False].structured.stats()
    assert on["num_jump_forward_tokens"] > 0 and off["num_jump_forward_tokens"] == 0
    # Off, each forced token takes a step with a one-token mask; on, it takes none.
    assert off["num_rows_forced"] >= on["num_rows_forced"] + on["num_jump_forward_tokens"]
    assert engines[True].num_steps < engines[False].num_steps


def test_logprobs_requests_do_not_jump_but_get_the_same_tokens(engine_factory):
    outs, engines = {}, {}
    for logprobs in (None, 1):
        engine = engines[logprobs] = engine_factory()
        engine.add_request("x", prompt=prompt(1), sampling_params=SamplingParams(
            temperature=0.0, max_tokens=200, structured_outputs=PERSON, logprobs=logprobs))
        outs[logprobs] = run(engine)["x"].outputs[0]
    plain, lp = outs[None], outs[1]
    assert lp.token_ids == plain.token_ids and len(lp.logprobs) == len(lp.token_ids)
    assert engines[None].structured.num_jump_forward_tokens > 0
    assert engines[1].structured.num_jump_forward_tokens == 0
    # A token the grammar forced had a one-token mask: the whole (masked) distribution, logprob 0.
    assert any(d[t].logprob == 0.0 for t, d in zip(lp.token_ids, lp.logprobs, strict=True))


def test_max_tokens_cut_gives_length_and_incomplete(engine_factory):
    engine = engine_factory()
    engine.add_request("full", prompt=prompt(3), sampling_params=SamplingParams(
        temperature=0.0, max_tokens=200, structured_outputs=PERSON))
    full = run(engine)["full"].outputs[0]
    n = len(full.token_ids)
    assert full.finish_reason == "stop" and full.structured_complete
    for max_tokens, reason, complete in ((n, "stop", True), (n - 1, "length", False), (5, "length", False)):
        engine.add_request("cut", prompt=prompt(3), sampling_params=SamplingParams(
            temperature=0.0, max_tokens=max_tokens, structured_outputs=PERSON))
        out = run(engine)["cut"].outputs[0]
        assert (out.finish_reason, out.structured_complete, out.structured) == (reason, complete, "json")
        assert out.token_ids == full.token_ids[:max_tokens]


def test_a_stop_string_marks_the_output_incomplete(engine_factory):
    engine = engine_factory()
    engine.add_request("s", prompt=prompt(3), sampling_params=SamplingParams(
        temperature=0.0, max_tokens=200, stop=['"year"'], structured_outputs=PERSON))
    out = run(engine)["s"].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == '"year"'
    assert out.structured_complete is False and out.text.startswith('{"title":"')


@pytest.mark.parametrize(("spec", "says"), [
    ({"regex": "[a-z"}, "regex"),
    ({"json": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}}, "uniqueItems"),
    ({"grammar": "start: foo\n"}, "grammar"),
    ({"grammar": "root ::= \"a\" missing\n"}, "grammar"),
    ({"json": {"type": "object", "properties": {"k": {"enum": list(range(300))}}}}, "bytes"),
])
def test_a_spec_that_does_not_compile_is_a_value_error_at_add_request(engine_factory, spec, says):
    engine = engine_factory(structured_limits=StructuredLimits(max_spec_bytes=1024))
    params = SamplingParams(max_tokens=10, structured_outputs=spec)
    with pytest.raises(ValueError, match=r"^structured_outputs: ") as e:
        engine.add_request("bad", prompt="x", sampling_params=params)
    assert says in str(e.value)
    assert engine.num_unfinished() == 0 and not engine.has_unfinished()


def test_one_schema_over_256_requests_compiles_once(engine_factory):
    engine = engine_factory()
    for i in range(256):  # equal schemas, distinct objects: one cache key
        params = SamplingParams(temperature=0.0, max_tokens=100, structured_outputs={
            "json": copy.deepcopy(JSON_SCHEMAS["flat_person"])})
        engine.add_request(f"r{i}", prompt=prompt(i), sampling_params=params)
    assert engine.structured.backend.num_compiles == 1
    done = run(engine)
    for out in done.values():
        check_output(StructuredOutputsParams(json=JSON_SCHEMAS["flat_person"]), out.outputs[0].text)
    assert engine.structured.num_compiles == 1


def test_n_completions_each_get_a_matcher_and_are_each_valid(engine_factory):
    engine = engine_factory()
    engine.add_request("n", prompt=prompt(9), sampling_params=SamplingParams(
        n=3, temperature=1.0, seed=11, max_tokens=200, structured_outputs=PERSON))
    seqs = engine.requests["n"].seqs
    assert len({id(s.matcher) for s in seqs}) == 3
    out = run(engine)["n"]
    assert len({c.text for c in out.outputs}) > 1  # three independent walks through the grammar
    for c in out.outputs:
        assert c.finish_reason == "stop" and c.structured_complete
        check_output(PERSON, c.text)


def test_a_matcher_failing_mid_generation_aborts_only_its_request(engine_factory):
    engine = engine_factory()
    for rid in ("a", "victim", "b"):
        engine.add_request(rid, prompt=prompt(len(rid)), sampling_params=SamplingParams(
            temperature=0.0, max_tokens=200, structured_outputs=PERSON))
    engine.add_request("free", prompt=prompt(7),
                       sampling_params=SamplingParams(temperature=0.0, max_tokens=20))
    for _ in range(3):
        engine.step()
    matcher = engine.requests["victim"].seqs[0].matcher
    backend = engine.structured.backend
    mask = backend.allocate_bitmask(1)
    backend.fill_bitmask([(matcher, 0)], mask)
    banned = (~unpack_bitmask(mask, 320)[0]).nonzero()[0].item()  # a token the grammar does not allow now
    assert not matcher.accept(banned) and matcher.error is not None
    done = run(engine)
    victim = done["victim"]
    assert victim.outputs[0].finish_reason == "abort" and victim.outputs[0].structured_complete is False
    assert victim.error is not None and "grammar" in victim.error
    assert victim.error_code == "invalid_request"  # the worker's row for it: never a retry
    for rid in ("a", "b"):
        assert done[rid].error is None and done[rid].error_code is None
        assert done[rid].outputs[0].finish_reason == "stop"
        check_output(PERSON, done[rid].outputs[0].text)
    assert done["free"].outputs[0].finish_reason == "length"
    assert engine.block_manager.num_free_blocks == engine.runner.num_blocks


def two_person_requests(engine):
    """``engine`` with requests ``ok`` and ``victim``, both greedy and constrained to PERSON."""
    for rid in ("ok", "victim"):
        engine.add_request(rid, prompt=prompt(len(rid)), sampling_params=SamplingParams(
            temperature=0.0, max_tokens=200, structured_outputs=PERSON))
    return engine


def test_a_matcher_raising_during_the_mask_fill_aborts_only_its_request(engine_factory):
    class Exploding:
        """A fault in one matcher on the helper thread (as a backend bug would be)."""

        def __init__(self, real):
            self.real = real

        def forced_tokens(self):
            raise RuntimeError("mask exploded")

        def __getattr__(self, name):
            return getattr(self.real, name)

    engine = two_person_requests(engine_factory())
    engine.step()
    victim = engine.requests["victim"].seqs[0]
    victim.matcher, victim.forced_tokens = Exploding(victim.matcher), None
    done = run(engine)
    assert done["victim"].outputs[0].finish_reason == "abort" and "mask exploded" in done["victim"].error
    assert done["victim"].error_code == "invalid_request"
    assert done["ok"].error is None and done["ok"].outputs[0].structured_complete
    check_output(PERSON, done["ok"].outputs[0].text)


def test_a_jump_forward_that_raises_ends_only_its_request_as_invalid(engine_factory):
    class Exploding:
        """Forced tokens that work for the mask fill, then fail when jump-forward asks again."""

        def __init__(self, real):
            self.real, self.calls = real, 0

        def forced_tokens(self):
            self.calls += 1
            if self.calls > 1:
                raise RuntimeError("forced tokens exploded")
            return self.real.forced_tokens()

        def __getattr__(self, name):
            return getattr(self.real, name)

    engine = two_person_requests(engine_factory())
    victim = engine.requests["victim"].seqs[0]
    victim.matcher = Exploding(victim.matcher)
    done = run(engine)
    assert done["victim"].error_code == "invalid_request" and "forced tokens exploded" in done["victim"].error
    assert done["ok"].error is None and done["ok"].outputs[0].structured_complete


# A regex of counted repeats: its lexer builds derivative expressions on every token. Under llguidance's
# own fuel (1,000,000) `(x{300}){300}` costs ~50 ms a step per request on a 49k vocabulary (and
# `(x{1000}){1000}` fails: "too many expressions constructed"); under StructuredLimits.lexer_fuel
# (100,000) both fail on their first token.
DFA_HEAVY = ("(x{1000}){1000}", "(x{300}){300}")


def test_a_grammar_over_its_limits_mid_decode_ends_only_its_request_as_invalid(engine_factory):
    lark_3000 = "start: " + " | ".join(f'"w{i}"' for i in range(3000)) + "\n"
    engine = engine_factory()
    victims = {"dfa0": {"regex": DFA_HEAVY[0]}, "dfa1": {"regex": DFA_HEAVY[1]},
               "lark": {"grammar": lark_3000}}
    for rid, spec in victims.items():  # each compiles, then fails on its first token
        engine.add_request(rid, prompt=prompt(1), sampling_params=SamplingParams(
            temperature=0.0, max_tokens=16, structured_outputs=spec))
    engine.add_request("ok", prompt=prompt(2), sampling_params=SamplingParams(
        temperature=0.0, max_tokens=200, structured_outputs=PERSON))
    engine.add_request("free", prompt=prompt(3),
                       sampling_params=SamplingParams(temperature=0.0, max_tokens=8))
    done = run(engine)
    for rid, says in (("dfa0", "too many expressions"), ("dfa1", "too many expressions"),
                      ("lark", "3001 items")):
        out = done[rid]
        assert out.error_code == "invalid_request" and says in out.error, (rid, out.error)
        assert out.error.startswith("structured_outputs: ") and out.outputs[0].finish_reason == "abort"
    assert done["ok"].error is None and done["ok"].outputs[0].finish_reason == "stop"
    check_output(PERSON, done["ok"].outputs[0].text)
    assert done["free"].error is None and done["free"].outputs[0].finish_reason == "length"
    assert engine.block_manager.num_free_blocks == engine.runner.num_blocks


def test_the_lexer_fuel_limit_is_the_engines_setting(engine_factory):
    """With llguidance's own fuel the same spec runs (at its cost a step); the default bounds it."""
    params = SamplingParams(temperature=0.0, max_tokens=6, structured_outputs={"regex": DFA_HEAVY[1]})
    unbounded = engine_factory(structured_limits=StructuredLimits(lexer_fuel=1_000_000))
    unbounded.add_request("x", prompt=prompt(1), sampling_params=params)
    out = run(unbounded)["x"]
    assert out.error is None and out.outputs[0].finish_reason == "length"
    assert set(out.outputs[0].text) == {"x"}
    bounded = engine_factory()
    assert bounded.config.structured_limits.lexer_fuel == 100_000
    bounded.add_request("x", prompt=prompt(1), sampling_params=params)
    assert run(bounded)["x"].error_code == "invalid_request"


def test_apply_masks_exactly_the_constrained_rows(engine_factory):
    """The CPU path masks runs of rows as views: the same result as one masked gather / scatter."""
    engine = engine_factory()
    kinds = ["free", "json", "json", "free", "regex", "free", "free", "choice"]
    specs = {"json": PERSON, "regex": StructuredOutputsParams(regex="[a-z]{3}"),
             "choice": StructuredOutputsParams(choice=["yes", "no"])}
    for i, kind in enumerate(kinds):
        engine.add_request(f"r{i}", prompt=prompt(i), sampling_params=SamplingParams(
            max_tokens=20, structured_outputs=specs.get(kind)))
    seqs = [engine.requests[f"r{i}"].seqs[0] for i in range(len(kinds))]
    logits = torch.randn(len(kinds), 320)
    expected = logits.clone()
    engine.structured.begin(seqs)
    engine.structured.apply(logits)
    rows = torch.tensor([i for i, k in enumerate(kinds) if k != "free"])
    apply_bitmask(expected, engine.structured._bitmask[:len(rows)], rows)
    assert torch.equal(logits, expected)
    free = [i for i, k in enumerate(kinds) if k == "free"]
    assert torch.isfinite(logits[free]).all()
    allowed = torch.isfinite(logits).sum(dim=1).tolist()
    assert allowed[1] == allowed[2] == 1  # the JSON object's forced '{"': one token
    assert 1 < allowed[4] < 320 and allowed[7] == 2  # [a-z] tokens; "y" / "n" (or "yes" / "no")


def test_llm_generate_takes_structured_outputs_and_the_engine_options(tiny_llama):
    import batchinfer

    llm = batchinfer.LLM(tiny_llama, num_kv_blocks=64, structured_outputs_backend="llguidance",
                         jump_forward=False)
    assert llm.engine.config.jump_forward is False
    params = [batchinfer.SamplingParams(max_tokens=100, structured_outputs=batchinfer.StructuredOutputsParams(
                  json=JSON_SCHEMAS["flat_person"])),
              batchinfer.SamplingParams(max_tokens=10, structured_outputs={"choice": ["red", "green"]})]
    person, color = (o.outputs[0] for o in llm.generate(["a", "b"], params))
    check_output(params[0].structured_outputs, person.text)
    assert color.text in ("red", "green") and color.structured == "choice" and color.structured_complete
    assert llm.engine.structured.num_jump_forward_tokens == 0
    with pytest.raises(ValueError, match=r"^prompts\[0\]: structured_outputs: regex: "):
        llm.generate(["x"], batchinfer.SamplingParams(structured_outputs={"regex": "(unclosed"}))
