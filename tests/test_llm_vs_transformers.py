"""The engine against transformers: greedy tokens identical, logits within 1e-4 (float32).

One ``generate`` call per architecture runs >= 16 mixed-length prompts through a budget that
forces chunked prefill and a KV pool small enough to force preemption, with prefix caching on
and then off. Each reference comes from ``transformers`` ``generate`` on the same checkpoint.
"""

from __future__ import annotations

import re

import pytest
import torch

from batchinfer import LLM, SamplingParams
from batchinfer.workers.models.tiny import make_tiny_model

transformers = pytest.importorskip("transformers")

ARCHITECTURES = ["LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"]
BUDGET = 64  # max_num_batched_tokens: longer prompts are prefilled in chunks
ATOL = 1e-4


def workload(seed: int = 0) -> tuple[list[list[int]], list[int]]:
    """18 prompts of 1..200 tokens (4 share a 40-token prefix) and their output lengths."""
    gen = torch.Generator().manual_seed(seed)
    lengths = [1, 3, 9, 16, 17, 31, 48, 64, 65, 90, 120, 150, 200, 33]
    prompts = [torch.randint(0, 300, (n,), generator=gen).tolist() for n in lengths]
    shared = torch.randint(0, 300, (40,), generator=gen).tolist()
    prompts += [shared + torch.randint(0, 300, (n,), generator=gen).tolist() for n in (1, 7, 25, 60)]
    max_tokens = [8 + (7 * i) % 17 for i in range(len(prompts))]
    return prompts, max_tokens


def hf_greedy(hf, prompt: list[int], max_new: int) -> tuple[list[int], list[torch.Tensor]]:
    """transformers' greedy tokens (no EOS stop, like ignore_eos) and its raw logits per step."""
    ids = torch.tensor([prompt])
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False,
                      eos_token_id=None, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    return out.sequences[0, len(prompt):].tolist(), [step[0].float() for step in out.logits]


@pytest.fixture(scope="module", params=ARCHITECTURES)
def model_and_refs(request, tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("models") / request.param, architecture=request.param)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts, max_tokens = workload()
    with torch.no_grad():
        refs = [hf_greedy(hf, p, n) for p, n in zip(prompts, max_tokens, strict=True)]
    return path, prompts, max_tokens, refs


@pytest.mark.parametrize("prefix_caching", [True, False], ids=["prefix-cache", "no-prefix-cache"])
def test_greedy_matches_transformers(model_and_refs, prefix_caching):
    path, prompts, max_tokens, refs = model_and_refs
    # 24 blocks of 16 = 384 KV tokens for ~1500 tokens of demand: sequences must be preempted.
    llm = LLM(path, num_kv_blocks=24, max_num_batched_tokens=BUDGET, max_num_seqs=16,
              enable_prefix_caching=prefix_caching)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=5) for n in max_tokens]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)

    engine = llm.engine
    assert engine.num_preemptions > 0, "the KV pool was meant to force preemption"
    assert max(len(p) for p in prompts) > BUDGET
    assert not engine.has_unfinished() and engine.block_manager.num_free_blocks == engine.runner.num_blocks
    if prefix_caching:
        assert engine.block_manager.num_hit_tokens > 0 and any(o.num_cached_tokens for o in outs)
    else:
        assert engine.block_manager.num_hit_tokens == 0
    for i, (out, (ref_tokens, ref_logits)) in enumerate(zip(outs, refs, strict=True)):
        completion = out.outputs[0]
        assert out.prompt_token_ids == prompts[i]
        assert completion.token_ids == ref_tokens, f"prompt {i} ({len(prompts[i])} tokens) diverges"
        assert completion.finish_reason == "length"
        # Logprobs are log_softmax of the raw logits: they match iff the logits match up to a shift.
        for step in (0, len(ref_tokens) - 1):
            ref = torch.log_softmax(ref_logits[step], dim=-1)
            lp = completion.logprobs[step]
            ids = list(lp)
            got = torch.tensor([lp[t].logprob for t in ids])
            assert torch.allclose(got, ref[ids], atol=ATOL, rtol=0), f"prompt {i}, step {step}"
            assert set(ids[1:]) <= set(ref.topk(5).indices.tolist()) | {ids[0]}
            assert lp[ids[0]].rank == 1  # greedy: the sampled token is the argmax


def test_final_step_logits_within_tolerance(model_and_refs):
    """The engine's last-token logits (not just their softmax) match transformers' raw logits."""
    path, prompts, max_tokens, refs = model_and_refs
    llm = LLM(path, num_kv_blocks=64, max_num_batched_tokens=BUDGET)
    engine = llm.engine
    for i in (0, 10, 12):
        tokens, logits = refs[i]
        engine.add_request(f"r{i}", prompt_token_ids=prompts[i] + tokens[:-1],
                           sampling_params=SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    got = {}
    while engine.scheduler.has_unfinished():  # the step's first half by hand, to see the logits
        plan = engine.scheduler.schedule()
        step_logits = engine.runner.execute(plan.scheduled)
        engine.scheduler.commit(plan)
        rows = [s.seq for s in plan.scheduled if s.samples]
        for seq, row in zip(rows, step_logits, strict=True):
            got[seq.request.request_id] = row
            engine.abort(seq.request.request_id)
    for i in (0, 10, 12):
        assert torch.allclose(got[f"r{i}"], refs[i][1][-1], atol=ATOL, rtol=0), f"prompt {i}"


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("models") / "llama", architecture="LlamaForCausalLM")


def test_n_greedy_completions_all_match_and_share_the_prompt(llama):
    hf = transformers.AutoModelForCausalLM.from_pretrained(llama, dtype=torch.float32).eval()
    prompt = list(range(5, 105))
    with torch.no_grad():
        ref, _ = hf_greedy(hf, prompt, 6)
    llm = LLM(llama, num_kv_blocks=64)
    (out,) = llm.generate({"prompt_token_ids": prompt},
                          SamplingParams(n=3, temperature=0.0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(c.token_ids == ref for c in out.outputs)
    # Siblings 1 and 2 reuse the 6 full prompt blocks sibling 0 computes in the same step.
    assert llm.engine.block_manager.num_hit_tokens == 2 * 96


def test_seeded_siblings_differ_and_reproduce(llama):
    llm = LLM(llama, num_kv_blocks=64)
    params = SamplingParams(n=2, temperature=1.0, seed=1234, max_tokens=12, ignore_eos=True)
    first = llm.generate("The quick brown fox", params, use_tqdm=False)[0]
    # Same request again, now sharing the batch with others: the same tokens.
    again = llm.generate(["Hello world", "The quick brown fox", "the cache"],
                         [SamplingParams(temperature=1.0, max_tokens=5), params,
                          SamplingParams(max_tokens=7)],
                         use_tqdm=False)[1]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in first.outputs]
    assert first.outputs[0].token_ids != first.outputs[1].token_ids
    assert first.outputs[0].text == llm.get_tokenizer().decode(first.outputs[0].token_ids)


def test_generate_validates_every_prompt_before_running_any(llama):
    llm = LLM(llama, num_kv_blocks=16, max_model_len=128)
    good = {"prompt_token_ids": [1, 2, 3]}
    cases = [
        ([good, {"prompt_token_ids": list(range(200))}], None, "prompts[1]: prompt_token_ids"),
        ([good, good], SamplingParams(max_tokens=126), "prompts[0]: max_tokens"),
        ([good, {"prompt_token_ids": [1, 99999]}], None, "prompts[1]: prompt_token_ids[1]"),
        ([good, {"tokens": [1]}], None, "prompts[1]: unknown key 'tokens'"),
        ([good, good], [SamplingParams()], "sampling_params: 1 given for 2 prompts"),
    ]
    for prompts, params, message in cases:
        with pytest.raises(ValueError, match=re.escape(message)):
            llm.generate(prompts, params, use_tqdm=False)
        assert not llm.engine.has_unfinished()
    for bad in ({"max_tokens": 0}, {"top_p": 1.5}, {"bogus": 1}):
        name = next(iter(bad))
        with pytest.raises(ValueError, match=name):
            SamplingParams.from_dict(bad)


def test_sampled_logprobs_ranks_and_cumulative_logprob_match_transformers(llama):
    """Sampled (not greedy) completions: every reported logprob is transformers' log_softmax of the
    logits at that position, ranks are 1-based ranks in that distribution, the top-k are its top-k,
    and cumulative_logprob sums the sampled tokens' logprobs."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(llama, dtype=torch.float32).eval()
    llm = LLM(llama, num_kv_blocks=64)
    k = 4
    prompts = [list(range(5, 40)), [7, 8, 9], list(range(100, 180))]
    params = SamplingParams(n=2, temperature=1.3, top_p=0.9, seed=5, max_tokens=10, ignore_eos=True,
                            logprobs=k)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    checked_outside = 0
    for prompt, out in zip(prompts, outs, strict=True):
        for completion in out.outputs:
            ids = torch.tensor([prompt + completion.token_ids])
            with torch.no_grad():  # teacher forcing: position p's logits predict token p + 1
                logits = hf(ids).logits[0, len(prompt) - 1:-1].float()
            ref = torch.log_softmax(logits, dim=-1)  # [steps, V]
            assert len(completion.logprobs) == len(completion.token_ids) == 10
            total = 0.0
            for step, (token, lp) in enumerate(zip(completion.token_ids, completion.logprobs, strict=True)):
                row = ref[step]
                for t, v in lp.items():
                    assert v.logprob == pytest.approx(row[t].item(), abs=ATOL), (step, t)
                    # rank = 1 + tokens more likely (within tolerance where logprobs nearly tie)
                    lo, hi = int((row > row[t] + ATOL).sum()) + 1, int((row > row[t] - ATOL).sum()) + 1
                    assert lo <= v.rank <= hi or (t == token and v.rank == k + 1), (step, t, v.rank)
                    assert v.decoded_token == llm.get_tokenizer().decode([t], skip_special_tokens=False)
                top = sorted((v.rank, t) for t, v in lp.items() if v.rank <= k)
                assert [r for r, _ in top] == list(range(1, k + 1))
                assert torch.allclose(torch.tensor([lp[t].logprob for _, t in top]), row.topk(k).values,
                                      atol=ATOL, rtol=0)
                checked_outside += lp[token].rank > k
                total += row[token].item()
            assert completion.cumulative_logprob == pytest.approx(total, abs=10 * ATOL)
    assert checked_outside > 0, "some sampled token was meant to fall outside the top k"
