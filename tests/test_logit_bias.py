"""``logit_bias``, ``allowed_token_ids`` and ``bad_words`` (issue 29), end to end.

The sampler on hand-made logits: the bias is added before every other stage (penalties, greedy,
temperature), masks touch only their rows, raw logprobs stay the unprocessed distribution, rows
without these fields cost no copy of the logits, and seeded rows draw the same tokens whatever
shares their batch. The engine on the tiny random Llama: a -100 bias on the greedy token changes
it, +100 forces a token, and greedy tokens equal ``transformers``' ``generate`` with the same
bias / mask / bad-word rule as a ``LogitsProcessor``. Through the real scheduler and a worker
daemon: a queued request's bias decides its tokens, and an out-of-vocabulary key is the request's
``invalid_request`` row, written by the scheduler before dispatch.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from daemons import ThreadedWorker, wait_until, worker_daemon

from batchinfer import LLM, SamplingParams
from batchinfer.config import Settings
from batchinfer.keys import Keys
from batchinfer.protocol.bodies import parse_body
from batchinfer.protocol.entries import IntakeEntry
from batchinfer.protocol.rows import ResultRow
from batchinfer.scheduler.daemon import SchedulerDaemon
from batchinfer.store.jobstore import JobStore
from batchinfer.workers.engine.sampler import Sampler, SamplingBatch, SamplingRow, make_generator

V = 12
EOS = 11
NEG = float("-inf")


def row(prompt=(1,), output=(), generator=None, bad=(), **params) -> SamplingRow:
    return SamplingRow(SamplingParams(**params), list(prompt), list(output), generator, bad)


# -- SamplingParams -----------------------------------------------------------------------------


def test_fields_are_normalised_and_round_trip_through_json():
    p = SamplingParams(logit_bias={"5": 100, 7: -2.5, "0": 0}, allowed_token_ids=(3, 4),
                       bad_words=["x", " y"])
    assert p.logit_bias == {5: 100.0, 7: -2.5, 0: 0.0}
    assert all(type(v) is float for v in p.logit_bias.values())
    assert p.allowed_token_ids == [3, 4] and p.bad_words == ["x", " y"]
    wire = json.loads(json.dumps(p.to_dict()))
    assert wire["logit_bias"] == {"5": 100.0, "7": -2.5, "0": 0.0}  # JSON's string keys
    assert SamplingParams.from_dict(wire) == p
    assert SamplingParams.from_dict({"logit_bias": None, "allowed_token_ids": None, "bad_words": None}) \
        == SamplingParams()


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"logit_bias": [1, 2]}, "logit_bias must be an object mapping token ids to numbers"),
    ({"logit_bias": {"abc": 1}}, "logit_bias keys must be token ids (non-negative integers"),
    ({"logit_bias": {"-1": 1}}, "logit_bias keys must be token ids"),
    ({"logit_bias": {-1: 1}}, "logit_bias keys must be token ids"),
    ({"logit_bias": {"1.5": 1}}, "logit_bias keys must be token ids"),
    ({"logit_bias": {" 12": 1}}, "logit_bias keys must be token ids"),
    ({"logit_bias": {"١٢": 1}}, "logit_bias keys must be token ids"),  # Arabic-Indic digits
    ({"logit_bias": {True: 1}}, "logit_bias keys must be token ids"),
    ({"logit_bias": {"9" * 19: 1}}, "logit_bias keys must be token ids"),
    ({"logit_bias": {"12": 1, 12: 2}}, "logit_bias names token 12 twice"),
    ({"logit_bias": {"12": 100.5}}, "logit_bias[12] must be in [-100, 100], got 100.5"),
    ({"logit_bias": {"12": -101}}, "logit_bias[12] must be in [-100, 100]"),
    ({"logit_bias": {"12": float("nan")}}, "logit_bias[12] must be in [-100, 100]"),
    ({"logit_bias": {"12": 10**400}}, "logit_bias[12] must be in [-100, 100], got an integer of 401"),
    ({"logit_bias": {"12": "5"}}, "logit_bias[12] must be a number, got '5'"),
    ({"logit_bias": {"12": True}}, "logit_bias[12] must be a number"),
    ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias may have at most 300 tokens, got 301"),
    ({"allowed_token_ids": []}, "allowed_token_ids must not be empty"),
    ({"allowed_token_ids": 5}, "allowed_token_ids must be a list of integers"),
    ({"allowed_token_ids": [1, -2]}, "allowed_token_ids[1] must be a non-negative integer, got -2"),
    ({"allowed_token_ids": [1, "2"]}, "allowed_token_ids[1] must be a non-negative integer"),
    ({"bad_words": "word"}, "bad_words must be a list of strings"),
    ({"bad_words": ["ok", 3]}, "bad_words[1] must be a string, got 3"),
    ({"bad_words": ["ok", ""]}, "bad_words[1] must not be empty"),
    ({"bad_words": ["w"] * 301}, "bad_words may have at most 300 words, got 301"),
])
def test_invalid_values_name_the_field(kwargs, message):
    with pytest.raises(ValueError) as err:
        SamplingParams(**kwargs)
    assert str(err.value).startswith(message), str(err.value)


def test_a_body_with_the_fields_parses_and_errors_name_the_field():
    spec = parse_body(json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
                                  "body": {"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                           "logit_bias": {"50256": -100}, "allowed_token_ids": [1, 2],
                                           "bad_words": ["no"]}}))
    p = spec.sampling_params
    assert (p.logit_bias, p.allowed_token_ids, p.bad_words) == ({50256: -100.0}, [1, 2], ["no"])
    for body, field in (({"logit_bias": {"x": 1}}, "logit_bias"),
                        ({"logit_bias": {"3": 200}}, "logit_bias[3]"),
                        ({"allowed_token_ids": [-1]}, "allowed_token_ids[0]"),
                        ({"bad_words": [""]}, "bad_words[0]")):
        with pytest.raises(ValueError) as err:
            parse_body(json.dumps({"prompt": "hi", **body}))
        assert err.value.field == field, err.value  # type: ignore[attr-defined]


# -- the sampler ----------------------------------------------------------------------------------


def logits_of(*rows: list[float]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


BASE = [0.5, 2.0, 1.0, -1.0, 0.0, 1.5, -0.5, 0.25, 3.0, -2.0, 0.75, 1.25]  # argmax 8


def test_a_bias_moves_greedy_and_is_added_before_the_penalties():
    logits = logits_of(BASE, BASE, BASE)
    rows = [row(temperature=0, logit_bias={8: -100}), row(temperature=0, logit_bias={3: 100}),
            row(temperature=0, logit_bias={2: 1.5}, repetition_penalty=2.0, prompt=[2], output=[2, 2],
                frequency_penalty=0.5)]
    sampler = Sampler(V, [EOS])
    processed = sampler.apply_penalties(logits, rows)
    assert processed[0, 8] == BASE[8] - 100 and processed[1, 3] == BASE[3] + 100
    # bias first: (1.0 + 1.5) / 2 for the repetition penalty, then - 0.5 * 2 for the frequency one
    assert processed[2, 2] == pytest.approx((1.0 + 1.5) / 2.0 - 0.5 * 2)
    untouched = [t for t in range(V) if t not in (2, 3, 8)]
    assert torch.equal(processed[:, untouched], logits[:, untouched])
    assert sampler(logits, rows).token_ids == [1, 3, 8]  # -100 on 8: the next best, 1; +100 forces 3


def test_the_bias_reaches_random_rows_through_temperature_top_k_and_top_p():
    logits = logits_of(*[BASE] * 64)
    rows = [row(temperature=1.5, top_k=3, top_p=0.9, seed=i, generator=make_generator(i, 0),
                logit_bias={4: 100}) for i in range(64)]
    assert Sampler(V, [EOS])(logits, rows).token_ids == [4] * 64


def test_raw_logprobs_are_those_of_the_unbiased_distribution():
    logits = logits_of(BASE)
    out = Sampler(V, [EOS])(logits, [row(temperature=0, logprobs=2, logit_bias={3: 100},
                                         allowed_token_ids=[3, 4], bad=[[4]])])
    raw = torch.log_softmax(logits[0], dim=-1)
    [lps] = out.logprobs
    assert out.token_ids == [3] and list(lps) == [3, 8, 1]  # the sampled token, then the raw top 2
    assert [lps[t].logprob for t in (3, 8, 1)] == pytest.approx([raw[3].item(), raw[8].item(), raw[1].item()])
    assert lps[3].rank == 1 + int((raw > raw[3]).sum())


def test_allowed_token_ids_restrict_every_draw_of_their_rows_only():
    logits = torch.randn(200, V, generator=torch.Generator().manual_seed(0))
    rows = [row(temperature=2.0, allowed_token_ids=[0, 5, 9]) if i % 2 else row(temperature=2.0)
            for i in range(200)]
    sampler = Sampler(V, [EOS], generator=torch.Generator().manual_seed(1))
    ids = sampler(logits, rows).token_ids
    assert {ids[i] for i in range(1, 200, 2)} <= {0, 5, 9}
    assert len({ids[i] for i in range(0, 200, 2)} - {0, 5, 9}) > 3  # the others draw from everything
    processed = sampler.apply_penalties(logits, rows)
    assert torch.equal(processed[::2], logits[::2])
    assert torch.equal(processed[1, [0, 5, 9]], logits[1, [0, 5, 9]])
    assert torch.isneginf(processed[1]).sum() == V - 3


def reference_bad_word_mask(output: list[int], words: list[list[int]]) -> set[int]:
    """vLLM's rule, written out: a word's last token is banned when its other tokens end the output."""
    banned = set()
    for w in words:
        k = len(w) - 1
        if k == 0 or (len(output) >= k and output[len(output) - k:] == w[:-1]):
            banned.add(w[-1])
    return banned


@pytest.mark.parametrize("output", [[], [5], [1, 5], [5, 6], [2, 5, 6], [6, 7, 5, 6], [3, 3]])
def test_bad_words_mask_the_last_token_of_each_word_whose_prefix_ends_the_output(output):
    words = [[4], [5, 6, 7], [6, 2], [3, 3, 3], [1, 5, 9], [10]]
    logits = logits_of(BASE, BASE)
    rows = [row(output=output, bad=words), row(output=output)]
    processed = Sampler(V, [EOS]).apply_penalties(logits, rows)
    banned = reference_bad_word_mask(output, words)
    assert {t for t in range(V) if math.isinf(processed[0, t].item())} == banned
    assert torch.equal(processed[1], logits[1])  # the other row: untouched


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_row_its_masks_leave_no_token_keeps_its_allowed_tokens(temperature):
    """allowed_token_ids that are all bad words, or all EOS under min_tokens: the step ignores the
    later masks for that row (a draw from nothing would give an id outside the vocabulary)."""
    logits = logits_of(BASE, BASE, BASE)
    rows = [row(temperature=temperature, allowed_token_ids=[EOS], min_tokens=3),
            row(temperature=temperature, allowed_token_ids=[2, 4], bad=[[2], [4]], logit_bias={2: 1.5}),
            row(temperature=temperature, allowed_token_ids=[2, 4], bad=[[2]])]
    sampler = Sampler(V, [EOS], generator=torch.Generator().manual_seed(0))
    processed = sampler.apply_penalties(logits, rows)
    assert processed[1, 2] == BASE[2] + 1.5 and processed[1, 4] == BASE[4]
    assert torch.isneginf(processed[0]).sum() == V - 1 and torch.isneginf(processed[1]).sum() == V - 2
    assert torch.isneginf(processed[2]).sum() == V - 1  # a live row keeps every mask
    ids = sampler(logits, rows).token_ids
    assert ids[0] == EOS and ids[1] in (2, 4) and ids[2] == 4


def test_rows_without_the_fields_cost_no_copy():
    logits = logits_of(BASE, BASE)
    sampler = Sampler(V, [EOS])
    assert sampler.apply_penalties(logits, [row(temperature=0), row(logit_bias={})]) is logits
    assert sampler.apply_penalties(logits, [row(temperature=0), row(logit_bias={3: 1})]) is not logits
    # a bad word whose prefix does not end the output masks nothing this step: no copy either
    assert sampler.apply_penalties(logits, [row(output=[1], bad=[[2, 3]]), row()]) is logits


def test_seeded_rows_draw_the_same_tokens_whatever_shares_their_batch():
    fields = dict(temperature=1.0, logit_bias={2: 1.5, 7: -1.0}, allowed_token_ids=[1, 2, 5, 7, 8])

    def seeded(i: int) -> SamplingRow:
        return row(seed=i, generator=make_generator(i, 0), bad=[[8], [2, 5]], output=[2] * (i % 3), **fields)

    logits = torch.randn(16, V, generator=torch.Generator().manual_seed(3))
    alone = [Sampler(V, [EOS])(logits[i:i + 1], [seeded(i)]).token_ids[0] for i in range(16)]
    others = [row(temperature=0), row(temperature=0.5, top_k=2), row(logit_bias={0: 5.0})]
    mixed = [seeded(i) for i in range(16)]
    batch = mixed[:5] + others + mixed[5:]
    batch_logits = torch.cat([logits[:5], torch.randn(3, V), logits[5:]])
    together = Sampler(V, [EOS])(batch_logits, batch).token_ids
    assert together[:5] + together[8:] == alone


def test_batch_updated_row_by_row_equals_one_built_from_scratch():
    kinds = [dict(temperature=0, logit_bias={3: 2.0}), dict(allowed_token_ids=[1, 2]),
             dict(bad=[[4], [1, 2]]), dict(min_tokens=2, logit_bias={EOS: 1.0, 2: -3.0}), dict(),
             dict(allowed_token_ids=[99, 5])]
    rows = [row(**k) for k in kinds]

    def state(batch: SamplingBatch) -> tuple:
        return (batch.tokens, batch.bias_rows, batch.bias_pair_rows.tolist(), batch.bias_pair_tokens.tolist(),
                batch.bias_values.tolist(), batch.allowed_rows, batch.allowed_pair_rows.tolist(),
                batch.allowed_pair_tokens.tolist(), batch.bad_words_rows)

    batch = SamplingBatch(V, [EOS])
    for step in (rows[:3], rows, rows[2:], rows[::-1], [rows[1], rows[1]], [], rows):
        batch.update(step)
        fresh = SamplingBatch(V, [EOS])
        fresh.update(step)
        assert state(batch) == state(fresh)
    assert batch.tokens[5].allowed == [5]  # an id past the vocabulary is dropped (the engine refuses it)


# -- the engine, against transformers ---------------------------------------------------------------

transformers = pytest.importorskip("transformers")
# prompts whose greedy output on the tiny Llama holds ASCII one- and two-token words (bad words)
PROMPT_TEXTS = ["Hello world, this is", "once upon a time", "Lorem ipsum dolor", "def f(x):"]
STEPS = 12


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(tiny_llama)


@pytest.fixture(scope="module")
def prompts(llm):
    return [llm.get_tokenizer().encode(t) for t in PROMPT_TEXTS]


@pytest.fixture(scope="module")
def hf(tiny_llama):
    return transformers.AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()


def greedy(llm: LLM, prompts: list[list[int]], **params) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True, **params),
                        use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


class Reference(transformers.LogitsProcessor):
    """The three fields as a transformers logits processor, written from their definitions."""

    def __init__(self, prompt_len: int, bias: dict[int, float] | None = None,
                 allowed: list[int] | None = None, bad: list[list[int]] | None = None):
        self.prompt_len, self.bias, self.allowed, self.bad = prompt_len, bias or {}, allowed, bad or []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        scores = scores.clone()
        for t, b in self.bias.items():
            scores[:, t] += b
        if self.allowed is not None:
            keep = torch.full_like(scores, NEG)
            keep[:, self.allowed] = 0.0
            scores = scores + keep
        output = input_ids[0, self.prompt_len:].tolist()
        for t in reference_bad_word_mask(output, self.bad):
            scores[:, t] = NEG
        return scores


def hf_greedy(hf, prompt: list[int], processor: Reference) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=STEPS, do_sample=False,
                          eos_token_id=None, pad_token_id=0,
                          logits_processor=transformers.LogitsProcessorList([processor]))
    return out[0, len(prompt):].tolist()


def test_a_minus_100_bias_on_the_greedy_token_changes_it_and_plus_100_forces_one(llm, prompts):
    plain = greedy(llm, prompts)
    for prompt, tokens in zip(prompts, plain, strict=True):
        [moved] = greedy(llm, [prompt], logit_bias={tokens[0]: -100})
        assert moved[0] != tokens[0]
        assert tokens[0] not in moved  # the bias holds at every step
        [forced] = greedy(llm, [prompt], logit_bias={str(moved[3]): 100})
        assert forced == [moved[3]] * STEPS


def words_in(tokens: list[int], tokenizer) -> list[str]:
    """A one-token and a two-token word of ``tokens`` (printable ASCII that encodes, as given, to
    exactly those tokens): bad words the unconstrained output certainly holds."""
    found: dict[int, str] = {}
    for n in (1, 2):
        for i in range(len(tokens) - n + 1):
            text = tokenizer.decode(tokens[i:i + n])
            if text.isascii() and text.isprintable() and text.strip() \
                    and tokenizer.encode(text, add_special_tokens=False) == tokens[i:i + n]:
                found[n] = text
                break
    assert len(found) == 2, f"no one- and two-token words in {tokens}"
    return [found[1], found[2]]


def token_sequences(words: list[str], tokenizer) -> list[list[int]]:
    """The bad words' definition: each word encoded as given and with a leading space."""
    return [tokenizer.encode(text, add_special_tokens=False) for w in words for text in (w, " " + w)]


def holds(tokens: list[int], seq: list[int]) -> bool:
    return any(tokens[i:i + len(seq)] == seq for i in range(len(tokens) - len(seq) + 1))


@pytest.mark.parametrize("case", ["bias", "allowed", "bad_words", "all"])
def test_greedy_tokens_equal_transformers_with_the_same_logits_processor(llm, hf, prompts, case):
    tokenizer = llm.get_tokenizer()
    plain = greedy(llm, prompts)
    for prompt, tokens in zip(prompts, plain, strict=True):
        bias = {tokens[0]: -100.0, tokens[2]: -3.5, 17: 4.0, 18: 2.25}
        allowed = sorted(set(tokens[1::2]) | {17, 40, 41, 42})
        words = words_in(tokens, tokenizer)
        fields = {"bias": dict(logit_bias=bias), "allowed": dict(allowed_token_ids=allowed),
                  "bad_words": dict(bad_words=words),
                  "all": dict(logit_bias=bias, allowed_token_ids=allowed, bad_words=words)}[case]
        bad = token_sequences(words, tokenizer) if "bad_words" in fields else None
        ref = Reference(len(prompt), fields.get("logit_bias"), fields.get("allowed_token_ids"), bad)
        [got] = greedy(llm, [prompt], **fields)
        assert got == hf_greedy(hf, prompt, ref), case
        assert got != tokens  # each case changes the output
        if "allowed_token_ids" in fields:
            assert set(got) <= set(allowed)
        for seq in bad or ():
            assert not holds(got, seq)
        if bad:
            assert all(holds(tokens, tokenizer.encode(w, add_special_tokens=False)) for w in words)


def test_bad_words_are_tokenised_as_given_and_with_a_leading_space_once_per_request(llm):
    tokenizer = llm.get_tokenizer()
    words = ["The", " request", "Ly", "The"]
    ids = llm.engine.input_processor.bad_words_token_ids(words)
    encode = [tokenizer.encode(t, add_special_tokens=False) for t in ("The", " The", " request", "Ly", " Ly")]
    assert ids == [e for i, e in enumerate(encode) if e not in encode[:i]]  # " request": as given only
    req = llm.engine.make_request("bw", prompt_token_ids=[1, 2], sampling_params={"bad_words": words, "n": 2})
    from batchinfer.workers.engine.processors import sampling_row

    # tokenised once, on the request; every completion's sampling row reads that one list
    assert req.bad_words_token_ids == ids
    assert all(sampling_row(s).bad_words_token_ids is req.bad_words_token_ids for s in req.seqs)
    plain = llm.engine.make_request("plain", prompt_token_ids=[1, 2])
    assert sampling_row(plain.seqs[0]).bad_words_token_ids == []


def test_sampled_completions_never_hold_a_bad_word_nor_a_token_outside_the_allowed(llm, prompts):
    tokenizer = llm.get_tokenizer()
    [tokens] = greedy(llm, prompts[:1])
    words = words_in(tokens, tokenizer)
    allowed = sorted(set(range(30, 90)) | set(tokens))
    [out] = llm.generate([{"prompt_token_ids": prompts[0]}],
                         SamplingParams(n=8, seed=4, temperature=1.5, max_tokens=40, ignore_eos=True,
                                        bad_words=words, allowed_token_ids=allowed), use_tqdm=False)
    for completion in out.outputs:
        got = list(completion.token_ids)
        assert len(got) == 40 and set(got) <= set(allowed)
        for seq in token_sequences(words, tokenizer):
            assert not holds(got, seq)


def test_the_engine_refuses_token_ids_outside_the_vocabulary(llm):
    vocab = llm.engine.input_processor.vocab_size
    for params, message in (
            ({"logit_bias": {str(vocab): 1}}, f"logit_bias keys must be token ids in [0, {vocab})"),
            ({"allowed_token_ids": [3, vocab]}, f"allowed_token_ids[1] must be a token id in [0, {vocab}), "
                                                f"got {vocab}")):
        with pytest.raises(ValueError) as err:
            llm.engine.make_request("oov", prompt_token_ids=[1, 2], sampling_params=params)
        assert str(err.value).startswith(message), str(err.value)
    llm.engine.make_request("in", prompt_token_ids=[1], sampling_params={"logit_bias": {str(vocab - 1): 1}})


# -- through the scheduler and a worker -------------------------------------------------------------

PREFIX = "{lb}"
KEYS = Keys(PREFIX)


def test_a_queued_requests_bias_decides_its_tokens_and_a_bad_key_is_refused_before_dispatch(
        redis_server, tiny_llama, llm):
    from batchinfer.workers.engine.engine import Engine

    r = redis_server.client()
    model = Path(tiny_llama).name
    [plain] = greedy(llm, [[5, 6, 7, 8]])
    target = 77 if plain[0] != 77 else 78
    engine = Engine.from_model(tiny_llama, num_kv_blocks=64, max_num_seqs=4, max_num_batched_tokens=64)
    worker = ThreadedWorker(worker_daemon(r, Settings(prefix=PREFIX, heartbeat_seconds=0.2), engine, "w"))
    sched = SchedulerDaemon(r, Settings(prefix=PREFIX), direct_hold_s=60)
    sched.admission.models.refresh = 0  # see the worker's registration at once
    JobStore(r, KEYS).create("j", model=model)
    base = {"prompt_token_ids": [5, 6, 7, 8], "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    bodies = [{**base, "logit_bias": {str(target): 100}}, {**base, "logit_bias": {str(plain[0]): -100}},
              {**base, "logit_bias": {"320": 5, "3": 1}}, {**base, "allowed_token_ids": [3, 4000]}, base]
    for i, body in enumerate(bodies):
        r.xadd(KEYS.requests, IntakeEntry(body=json.dumps(body), job_id="j", idx=i, line=i + 1).to_fields())

    def rows() -> dict[int, ResultRow]:
        found = (ResultRow.from_json(f[b"row"]) for _, f in r.xrange(KEYS.results("j")))
        return {row.idx: row for row in found}

    wait_until(lambda: len(rows()) == len(bodies), tick=sched.run_once, timeout=120, what="every row")
    assert worker.stop() == 0
    got = rows()
    assert got[0].status == "completed" and got[0].output_token_ids == [target] * 4
    assert got[1].status == "completed" and plain[0] not in (got[1].output_token_ids or [])
    assert got[4].status == "completed" and got[4].output_token_ids == plain[:4]
    for idx, field in ((2, "logit_bias[320]"), (3, "allowed_token_ids[1]")):
        row = got[idx]
        assert (row.status, row.error_code, row.worker) == ("failed", "invalid_request", None), row
        assert row.error_message.startswith(f"{field}: token id "), row.error_message
        assert "outside the model's vocabulary of 320 tokens" in row.error_message
