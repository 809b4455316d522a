"""Gemma 2 and Gemma 3 (text) against transformers on tiny random checkpoints.

The checkpoints are built with transformers' own config and model classes (so config.json and
the tensor names are exactly what transformers writes), with weights redrawn at scales that make
every Gemma feature matter: attention soft-capping (Gemma 2) and final-logit soft-capping at
small caps, a sliding window of 8 under prompts of up to 200 tokens, (1 + w) norms away from 1,
``query_pre_attn_scalar`` != head_dim, and for Gemma 3 q/k norms and two RoPE tables (linear-
scaled global, plain local). The comparisons are those of tests/test_llm_vs_transformers.py:
greedy tokens and logprobs under chunked prefill, preemption and prefix caching, and raw
final-step logits.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from batchinfer import LLM, SamplingParams
from batchinfer.workers.models import ModelConfig, load_model
from batchinfer.workers.models.tiny import tokenizer_files

transformers = pytest.importorskip("transformers")

# The shared comparisons run here against this module's `model_and_refs` fixture (pytest collects
# imported test functions in the importing module and resolves their fixtures here).
from test_llm_vs_transformers import (  # noqa: E402
    hf_greedy,
    test_final_step_logits_within_tolerance,  # noqa: F401
    test_greedy_matches_transformers,  # noqa: F401
    workload,
)

pytestmark = pytest.mark.slow  # ~15 s on two idle cores (transformers' eager Gemma generate dominates)

WINDOW = 8
COMMON = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-6,
              sliding_window=WINDOW, query_pre_attn_scalar=24, tie_word_embeddings=True,
              bos_token_id=312, eos_token_id=313, pad_token_id=315)
VARIANTS = {
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(
        num_hidden_layers=3, attn_logit_softcapping=3.0, final_logit_softcapping=5.0)),  # layers S, F, S
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        num_hidden_layers=3, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
        final_logit_softcapping=None)),
}


# Tied logits read the embedding: a small input embedding and branch norms near (1 + 1) let the
# layers dominate the residual stream (else each token predicts itself), and the final norm near
# (1 + 7) gives logits of std ~4, so the final cap of 5 bends them.
EMBED_STD = 0.5
NORM_BASE = {"post_attention_layernorm": 1.0, "post_feedforward_layernorm": 1.0, "norm": 7.0}


def make_gemma(path, variant: str, seed: int = 0, **overrides):
    """A tiny random Gemma checkpoint (+ the tiny models' tokenizer files) written by transformers."""
    config_cls, model_cls, extra = VARIANTS[variant]
    config = getattr(transformers, config_cls)(**{**COMMON, **extra, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):  # Gemma norms scale by (1 + w): w around 0, not 0
                base = NORM_BASE.get(name.rsplit(".", 2)[-2], 0.0)
                p.copy_(base + 0.3 * torch.randn(p.shape, generator=gen))
            elif name == "model.embed_tokens.weight":  # times sqrt(64) = 8 on the way in: std EMBED_STD
                p.copy_(EMBED_STD * torch.randn(p.shape, generator=gen) / 64**0.5)
            else:  # projections: q/k peaked (soft-capping and positions matter), o/down at gain 2
                gain = 2.0 if name.endswith(("o_proj.weight", "down_proj.weight")) else 1.0
                gain = 1.5 if name.endswith(("q_proj.weight", "k_proj.weight")) else gain
                p.copy_(gain * torch.randn(p.shape, generator=gen) / p.shape[1] ** 0.5)
    model.save_pretrained(path)
    for name, data in tokenizer_files(COMMON["max_position_embeddings"]).items():
        if name != "generation_config.json":
            (path / name).write_bytes(data)
    return path, model


@pytest.fixture(scope="module", params=list(VARIANTS))
def model_and_refs(request, tmp_path_factory):
    path, _ = make_gemma(tmp_path_factory.mktemp("models") / request.param, request.param)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts, max_tokens = workload()
    with torch.no_grad():
        refs = [hf_greedy(hf, p, n) for p, n in zip(prompts, max_tokens, strict=True)]
    # Varied greedy tokens (not one token repeated), so equal tokens mean equal models.
    assert len({t for tokens, _ in refs for t in tokens}) > 40
    return path, prompts, max_tokens, refs


def test_gemma2_config_fields(tmp_path):
    path, _ = make_gemma(tmp_path / "g2", "gemma2")
    config = ModelConfig.from_dir(path)
    assert config.architecture == "Gemma2ForCausalLM"
    assert config.layer_types == ("sliding_attention", "full_attention", "sliding_attention")
    assert [config.layer_sliding_window(i) for i in range(3)] == [WINDOW, None, WINDOW]
    assert config.attn_logit_softcapping == 3.0 and config.final_logit_softcapping == 5.0
    assert config.query_pre_attn_scalar == 24 and config.hidden_act == "gelu_pytorch_tanh"
    assert config.norm_unit_offset and config.sandwich_norms and config.scale_embeddings
    assert config.tie_word_embeddings and not config.qk_norm and config.rope_local_theta is None


def test_gemma3_config_fields_in_both_transformers_dialects(tmp_path):
    path, _ = make_gemma(tmp_path / "g3", "gemma3", attn_logit_softcapping=3.0)
    config = ModelConfig.from_dir(path)
    assert config.architecture == "Gemma3ForCausalLM" and config.qk_norm
    assert config.attn_logit_softcapping is None  # transformers' Gemma 3 never soft-caps attention
    assert config.final_logit_softcapping is None
    assert config.rope_theta == 1e6 and config.rope_scaling is not None
    assert (config.rope_scaling["rope_type"], config.rope_scaling["factor"]) == ("linear", 2.0)
    assert (config.rope_local_theta, config.rope_local_scaling) == (10000.0, None)
    # transformers 4.x: rope_theta + rope_scaling (global), rope_local_base_freq, sliding_window_pattern.
    legacy = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "vocab_size": 320,
              "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 7, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 16, "rope_theta": 1e6, "rope_local_base_freq": 1e4,
              "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "sliding_window": 512,
              "sliding_window_pattern": 6, "query_pre_attn_scalar": 16,
              "hidden_activation": "gelu_pytorch_tanh"}
    old = ModelConfig.from_dict(legacy)
    assert old.layer_types == ("sliding_attention",) * 5 + ("full_attention", "sliding_attention")
    assert (old.rope_theta, old.rope_scaling["factor"], old.rope_local_theta, old.rope_local_scaling) == (
        1e6, 8.0, 1e4, None)
    assert old.tie_word_embeddings  # Gemma's default when config.json leaves it out
    no_type = ModelConfig.from_dict({k: v for k, v in legacy.items() if k != "architectures"})
    assert no_type.architecture == "Gemma3ForCausalLM"


@pytest.mark.parametrize("bad,message", [
    ({"hidden_activation": "relu"}, "hidden_activation 'relu' is not supported"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention is not supported"),
    ({"final_logit_softcapping": 0}, "final_logit_softcapping must be > 0"),
])
def test_gemma_config_errors(bad, message):
    config = {"architectures": ["Gemma2ForCausalLM"], "vocab_size": 320, "hidden_size": 64,
              "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, **bad}
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dict(config)


def test_unsupported_architecture_lists_gemma():
    with pytest.raises(ValueError, match="unsupported architecture Gemma3ForConditionalGeneration; "
                                         "supported: .*Gemma2ForCausalLM, Gemma3ForCausalLM"):
        ModelConfig.from_dict({"architectures": ["Gemma3ForConditionalGeneration"]})


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_every_gemma_feature_changes_the_output(tmp_path, variant):
    """Each feature is load-bearing in these checkpoints: switching one off in our decoder moves
    the logits far past the comparison's tolerance (so the comparisons above test it)."""
    path, _ = make_gemma(tmp_path / variant, variant)
    model = load_model(path, progress=False)
    ids = torch.tensor(workload()[0][12][:40])
    llm_logits = _dense_logits(model, ids)
    switches = {
        "window": lambda m: [setattr(layer.self_attn, "sliding_window", None) for layer in m.layers],
        "embed_scale": lambda m: setattr(m, "embed_scale", None),
        "final_softcap": lambda m: setattr(m, "config", _replace(m.config, final_logit_softcapping=None)),
        "query_pre_attn_scalar": lambda m: [setattr(a.self_attn, "scale", 16**-0.5) for a in m.layers],
    }
    if variant == "gemma2":
        switches["attn_softcap"] = lambda m: [setattr(layer.self_attn, "softcap", None) for layer in m.layers]
    else:
        switches["local_rope"] = lambda m: setattr(m, "cos_sin_local", m.cos_sin_cache)
        del switches["final_softcap"]
    for name, switch in switches.items():
        changed = load_model(path, progress=False)
        switch(changed)
        diff = (_dense_logits(changed, ids) - llm_logits).abs().max().item()
        assert diff > 1e-2, f"{variant}: switching off {name} changed the logits by only {diff}"


def test_bfloat16_gemma_tracks_transformers(tmp_path):
    """In bf16 the (1 + w) norm, the embedding scale and the soft-caps round where transformers
    rounds: the engine's greedy tokens equal transformers' bf16 ones on short prompts."""
    path, _ = make_gemma(tmp_path / "g2", "gemma2")
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    prompts = [p[:30] for p in workload()[0][8:12]]
    llm = LLM(path, dtype="bfloat16", num_kv_blocks=32)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    with torch.no_grad():
        refs = [hf_greedy(hf, p, 6)[0] for p in prompts]
    agree = sum(o.outputs[0].token_ids == r for o, r in zip(outs, refs, strict=True))
    assert agree >= len(prompts) - 1, "bf16 near-ties may flip one prompt, not more"


def _replace(config: ModelConfig, **changes) -> ModelConfig:
    return dataclasses.replace(config, **changes)


def _dense_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """One whole-prompt forward through the paged path (one sequence, reference attention)."""
    from batchinfer.workers.models.attention import AttentionMetadata

    T, bs = ids.shape[0], 16
    blocks = -(-T // bs)
    shape = (blocks, bs, model.num_kv_heads, model.head_dim)
    caches = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(model.num_layers)]
    meta = AttentionMetadata(
        slot_mapping=torch.arange(T), block_tables=torch.arange(blocks, dtype=torch.int32)[None],
        cu_seqlens_q=torch.tensor([0, T], dtype=torch.int32), seq_lens=torch.tensor([T], dtype=torch.int32),
        max_seqlen_q=T, max_seqlen_k=T, backend="reference")
    with torch.no_grad():
        hidden = model(ids, torch.arange(T), caches, meta)
    return model.compute_logits(hidden)
