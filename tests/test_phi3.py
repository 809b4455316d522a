"""Phi-3 (``Phi3ForCausalLM``) against transformers: fused qkv / gate_up in the checkpoint, LongRoPE,
partial rotary, a sliding window.

Tiny random checkpoints: "long" has ``original_max_position_embeddings = 32`` of 512. The engine keeps one
LongRoPE regime per model (docs/engine.md, "RoPE"): the long factors when its table is longer
than the original context, so the "long" model is compared on prompts above 32 tokens (where
transformers uses the long factors too); the "short" model's context is its original one, so
every prompt there (below and above 32, up to 64) uses the short factors in both. Both run through
chunked prefill, preemption and prefix caching, and their logits are checked at every position.
"""

from __future__ import annotations

import pytest
import torch
from test_llm_vs_transformers import ATOL, hf_greedy
from test_models import check_against_transformers

from batchinfer import LLM, SamplingParams
from batchinfer.workers.models import ModelConfig, load_model
from batchinfer.workers.models.tiny import random_weights, tokenizer_files

transformers = pytest.importorskip("transformers")

ORIGINAL = 32
BUDGET = {"long": 48, "short": 24}  # max_num_batched_tokens: long prompts are prefilled in chunks


def make_tiny_phi3(path, max_positions: int, seed: int = 0, rope: dict | None = None, **overrides):
    """A random Phi-3 checkpoint, config written by transformers' Phi3Config (its 5.x form)."""
    from safetensors.torch import save_file

    rotary = 8  # head_dim 16 * partial_rotary_factor 0.5: LongRoPE factors per rotated frequency
    fields = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
                  original_max_position_embeddings=ORIGINAL, rms_norm_eps=1e-5, tie_word_embeddings=False,
                  bos_token_id=312, eos_token_id=313, pad_token_id=315,
                  rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                   "partial_rotary_factor": 0.5,
                                   "short_factor": [1.0 + 0.1 * i for i in range(rotary // 2)],
                                   "long_factor": [1.0 + 3.0 * i for i in range(rotary // 2)],
                                   **(rope or {})})
    fields.update(overrides)
    config = transformers.Phi3Config(**fields)
    config.architectures = ["Phi3ForCausalLM"]
    config.save_pretrained(path)
    # Well-scaled random weights of the same shapes, fused the way Phi-3 checkpoints store them.
    llama_like = {**fields, "architectures": ["LlamaForCausalLM"], "torch_dtype": "float32"}
    tensors = random_weights(llama_like, seed)
    for i in range(fields["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors[p + "self_attn.qkv_proj.weight"] = torch.cat(
            [tensors.pop(p + f"self_attn.{n}_proj.weight") for n in "qkv"])
        tensors[p + "mlp.gate_up_proj.weight"] = torch.cat(
            [tensors.pop(p + f"mlp.{n}_proj.weight") for n in ("gate", "up")])
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    for name, data in tokenizer_files(max_positions).items():
        (path / name).write_bytes(data)
    return path


@pytest.fixture(scope="module")
def long_phi3(tmp_path_factory):
    """512 positions over an original 32, a sliding window of 80: the long factors throughout."""
    return make_tiny_phi3(tmp_path_factory.mktemp("phi3-long"), 512, sliding_window=80)


@pytest.fixture(scope="module")
def short_phi3(tmp_path_factory):
    """Its context is its original 64 (``factor`` 4 given, so the attention factor is not 1)."""
    return make_tiny_phi3(tmp_path_factory.mktemp("phi3-short"), 64, seed=1, rope={"factor": 4.0},
                          original_max_position_embeddings=64)


def test_config_and_fused_weights(long_phi3):
    config = ModelConfig.from_dir(long_phi3)
    assert config.architecture == "Phi3ForCausalLM"
    assert (config.rotary_dim, config.partial_rotary_factor) == (8, 0.5)
    assert config.rope_scaling["rope_type"] == "longrope"
    assert config.rope_scaling["original_max_position_embeddings"] == ORIGINAL
    assert config.rope_scaling["factor"] == 512 / ORIGINAL
    assert [config.layer_sliding_window(i) for i in range(2)] == [80, 80]
    assert not (config.qkv_bias or config.o_bias or config.mlp_bias or config.qk_norm)
    from safetensors.torch import load_file

    stored = load_file(str(long_phi3 / "model.safetensors"))
    model = load_model(long_phi3, progress=False)
    layer0, layer1 = model.layers[0], model.layers[1]
    assert torch.equal(layer1.self_attn.qkv_proj.weight, stored["model.layers.1.self_attn.qkv_proj.weight"])
    assert torch.equal(layer0.mlp.gate_up_proj.weight, stored["model.layers.0.mlp.gate_up_proj.weight"])
    assert model.cos_sin_cache.shape == (512, 8)


def test_missing_fused_tensor_is_named(long_phi3, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    broken = shutil.copytree(long_phi3, tmp_path / "broken")
    tensors = load_file(str(broken / "model.safetensors"))
    del tensors["model.layers.1.mlp.gate_up_proj.weight"]
    save_file(tensors, str(broken / "model.safetensors"))
    with pytest.raises(ValueError, match=r"layers\.1\.mlp\.gate_up_proj\.weight \(gate part\)"):
        load_model(broken, progress=False)


@pytest.mark.parametrize("which", ["long", "short"])
def test_logits_match_transformers_at_every_position(request, which):
    """Ragged prefill, then decode steps mixed with a prefill chunk (tests/test_models.py's check)."""
    model_dir = request.getfixturevalue(f"{which}_phi3")
    lengths = [40, 70, 33] if which == "long" else [5, 17, 1, 31, 50]  # long: all above 32
    check_against_transformers(model_dir, lengths=lengths, decode_steps=2)


def _workload(which: str, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    gen = torch.Generator().manual_seed(seed)
    if which == "long":  # every prompt above the original 32 tokens; 150 > the window of 80
        lengths, shared, tails = [33, 47, 65, 90, 150], 40, (1, 25, 60)
    else:  # below and above 32, within the context of 64
        lengths, shared, tails = [1, 9, 17, 31, 33, 48], 20, (1, 25)
    prompts = [torch.randint(0, 300, (n,), generator=gen).tolist() for n in lengths]
    prefix = torch.randint(0, 300, (shared,), generator=gen).tolist()
    prompts += [prefix + torch.randint(0, 300, (n,), generator=gen).tolist() for n in tails]
    max_tokens = [8 + (7 * i) % 17 for i in range(len(prompts))]
    if which == "short":
        max_tokens = [min(n, 63 - len(p)) for p, n in zip(prompts, max_tokens, strict=True)]
    return prompts, max_tokens


@pytest.fixture(scope="module", params=["long", "short"])
def phi3_refs(request):
    model_dir = request.getfixturevalue(f"{request.param}_phi3")
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompts, max_tokens = _workload(request.param)
    with torch.no_grad():
        refs = [hf_greedy(hf, p, n) for p, n in zip(prompts, max_tokens, strict=True)]
    return request.param, model_dir, prompts, max_tokens, refs


@pytest.mark.slow
@pytest.mark.parametrize("prefix_caching", [True, False], ids=["prefix-cache", "no-prefix-cache"])
def test_greedy_tokens_and_logprobs_match_transformers(phi3_refs, prefix_caching):
    which, model_dir, prompts, max_tokens, refs = phi3_refs
    # A KV pool far below the demand: sequences are preempted and recomputed.
    llm = LLM(model_dir, num_kv_blocks=20 if which == "long" else 8, max_num_batched_tokens=BUDGET[which],
              max_num_seqs=16, enable_prefix_caching=prefix_caching)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=5) for n in max_tokens]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    engine = llm.engine
    assert engine.num_preemptions > 0 and max(len(p) for p in prompts) > BUDGET[which]
    assert (engine.block_manager.num_hit_tokens > 0) is prefix_caching
    assert engine.block_manager.num_free_blocks == engine.runner.num_blocks
    for i, (out, (ref_tokens, ref_logits)) in enumerate(zip(outs, refs, strict=True)):
        completion = out.outputs[0]
        assert completion.token_ids == ref_tokens, f"prompt {i} ({len(prompts[i])} tokens) diverges"
        for step in (0, len(ref_tokens) - 1):
            ref = torch.log_softmax(ref_logits[step], dim=-1)
            lp = completion.logprobs[step]
            got = torch.tensor([lp[t].logprob for t in lp])
            assert torch.allclose(got, ref[list(lp)], atol=ATOL, rtol=0), f"prompt {i}, step {step}"


def test_final_logits_match_transformers(phi3_refs):
    """The engine's raw last-token logits, not only their softmax."""
    which, model_dir, prompts, max_tokens, refs = phi3_refs
    engine = LLM(model_dir, num_kv_blocks=64, max_num_batched_tokens=BUDGET[which]).engine
    picked = range(0, len(prompts), 3)
    for i in picked:
        tokens = refs[i][0]
        engine.add_request(f"r{i}", prompt_token_ids=prompts[i] + tokens[:-1],
                           sampling_params=SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    got = {}
    while engine.scheduler.has_unfinished():
        plan = engine.scheduler.schedule()
        logits = engine.runner.execute(plan.scheduled)
        engine.scheduler.commit(plan)
        for s, row in zip([s for s in plan.scheduled if s.samples], logits, strict=True):
            got[s.seq.request.request_id] = row
            engine.abort(s.seq.request.request_id)
    for i in picked:
        assert torch.allclose(got[f"r{i}"], refs[i][1][-1], atol=ATOL, rtol=0), f"prompt {i}"
