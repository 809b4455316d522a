"""RoPE tables against transformers' own init functions, for every scaling type and both config forms.

Each case is parsed twice by ``ModelConfig`` (transformers 5's ``rope_parameters`` and 4's
``rope_scaling`` + ``rope_theta`` + ``partial_rotary_factor``) and once by transformers; the
inverse frequencies, the attention factor and the whole cos / sin table must agree.
"""

from __future__ import annotations

import math
import re

import pytest
import torch
from test_llm_vs_transformers import ATOL, hf_greedy
from test_models import check_against_transformers

from batchinfer import LLM, SamplingParams
from batchinfer.workers.models import ModelConfig
from batchinfer.workers.models.model_config import SUPPORTED_ROPE_TYPES
from batchinfer.workers.models.rope import ROPE_TYPES, attention_factor, cos_sin_cache, inv_frequencies
from batchinfer.workers.models.tiny import make_tiny_model

transformers = pytest.importorskip("transformers")

HEAD_DIM, MAX_POS, THETA = 16, 256, 5000.0
BASE = {"architectures": ["LlamaForCausalLM"], "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": HEAD_DIM,
        "max_position_embeddings": MAX_POS}


def _longrope(n: int) -> dict:
    return {"rope_type": "longrope", "original_max_position_embeddings": 64,
            "short_factor": [1.0 + 0.05 * i for i in range(n)],
            "long_factor": [1.0 + 0.5 * i for i in range(n)]}


# Fields use a small original context so every band of yarn / llama3 occurs in a 16-dim head.
CASES = {
    "default": lambda n: {"rope_type": "default"},
    "linear": lambda n: {"rope_type": "linear", "factor": 4.0},
    "dynamic": lambda n: {"rope_type": "dynamic", "factor": 4.0},
    "yarn": lambda n: {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    "yarn-mscale": lambda n: {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32,
                              "mscale": 0.707, "mscale_all_dim": 1.0, "beta_fast": 16, "beta_slow": 2},
    "yarn-attention-factor-untruncated": lambda n: {"rope_type": "yarn", "factor": 2.0, "truncate": False,
                                                    "original_max_position_embeddings": 128,
                                                    "attention_factor": 1.25},
    "yarn-implicit-factor": lambda n: {"rope_type": "yarn", "factor": None,
                                       "original_max_position_embeddings": 64},
    "longrope": _longrope,
    "longrope-attention-factor": lambda n: {**_longrope(n), "attention_factor": 1.1},
    "llama3": lambda n: {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
}


def _forms(case: dict, partial: float) -> tuple[dict, dict]:
    """(transformers 5 config dict, transformers 4 config dict) of one rope case."""
    v5 = {**BASE, "rope_parameters": {**case, "rope_theta": THETA, "partial_rotary_factor": partial}}
    legacy = {("type" if k == "rope_type" else k): v for k, v in case.items()}
    v4 = {**BASE, "rope_theta": THETA, "partial_rotary_factor": partial,
          "rope_scaling": None if case["rope_type"] == "default" else legacy}
    return v5, v4


def _hf_config(case: dict, partial: float):
    params = {**case, "rope_theta": THETA, "partial_rotary_factor": partial}
    return transformers.LlamaConfig(**{k: v for k, v in BASE.items() if k != "architectures"},
                                    rope_parameters=params)


def _hf_init(hf_config, seq_len=None) -> tuple[torch.Tensor, float]:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    rope_type = hf_config.rope_parameters["rope_type"]
    if rope_type == "default":  # Phi-3's default honours partial_rotary_factor (Llama's ignores it)
        return Phi3RotaryEmbedding.compute_default_rope_parameters(hf_config)
    return ROPE_INIT_FUNCTIONS[rope_type](hf_config, "cpu", seq_len=seq_len)


def _table(inv_freq: torch.Tensor, scale: float, positions: int) -> torch.Tensor:
    """transformers' forward: cos / sin of position * inv_freq, times the attention scaling."""
    freqs = torch.arange(positions).float()[:, None] * inv_freq[None, :]
    return torch.cat([freqs.cos() * scale, freqs.sin() * scale], dim=-1)


@pytest.mark.parametrize("partial", [1.0, 0.5], ids=["full", "partial"])
@pytest.mark.parametrize("name", list(CASES))
def test_both_config_forms_give_transformers_tables(name, partial):
    rotary = int(HEAD_DIM * partial)
    case = CASES[name](rotary // 2)
    v5, v4 = _forms(case, partial)
    ours, legacy = ModelConfig.from_dict(v5), ModelConfig.from_dict(v4)
    assert (ours.rope_theta, ours.rope_scaling, ours.rotary_dim) == (legacy.rope_theta, legacy.rope_scaling,
                                                                     legacy.rotary_dim)
    assert ours.rope_theta == THETA and ours.rotary_dim == rotary and ours.partial_rotary_factor == partial
    assert (ours.rope_scaling or {"rope_type": "default"})["rope_type"] == case["rope_type"]

    hf_config = _hf_config(case, partial)
    # The table's length decides dynamic's and longrope's regime, as seq_len does in transformers.
    for seq_len in (None, 48, MAX_POS, 1000):
        ref_inv, ref_scale = _hf_init(hf_config, seq_len)
        inv = inv_frequencies(rotary, ours.rope_theta, ours.rope_scaling, seq_len=seq_len)
        torch.testing.assert_close(inv, ref_inv.float(), atol=0, rtol=1e-6, msg=f"seq_len {seq_len}")
        assert attention_factor(ours.rope_scaling) == pytest.approx(ref_scale, rel=1e-12)

    ref_inv, ref_scale = _hf_init(hf_config, MAX_POS)
    table = cos_sin_cache(MAX_POS, rotary, ours.rope_theta, ours.rope_scaling)
    assert table.shape == (MAX_POS, rotary) and table.dtype == torch.float32
    torch.testing.assert_close(table, _table(ref_inv, ref_scale, MAX_POS), atol=1e-6, rtol=0)
    if name != "default" and name != "dynamic":  # dynamic is plain RoPE inside the model's context
        assert not torch.allclose(table, cos_sin_cache(MAX_POS, rotary, THETA, None))


@pytest.mark.parametrize("name", list(CASES))
def test_table_matches_transformers_rotary_module(name):
    """transformers' own module (its dynamic / longrope update included) over positions 0..MAX_POS-1."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    case = CASES[name](HEAD_DIM // 2)
    ours = ModelConfig.from_dict(_forms(case, 1.0)[0])
    module = LlamaRotaryEmbedding(_hf_config(case, 1.0))
    cos, sin = module(torch.zeros(1, dtype=torch.float32), torch.arange(MAX_POS)[None])
    table = cos_sin_cache(MAX_POS, HEAD_DIM, ours.rope_theta, ours.rope_scaling)
    half = HEAD_DIM // 2
    torch.testing.assert_close(table[:, :half], cos[0, :, :half], atol=1e-6, rtol=0)
    torch.testing.assert_close(table[:, half:], sin[0, :, :half], atol=1e-6, rtol=0)


def test_longrope_regime_follows_the_table_length():
    """Long factors only in a table longer than the original context (vLLM's rule), short otherwise."""
    scaling = ModelConfig.from_dict({**BASE, "rope_scaling": _longrope(8)}).rope_scaling
    short = cos_sin_cache(64, HEAD_DIM, 10000.0, scaling)
    long = cos_sin_cache(MAX_POS, HEAD_DIM, 10000.0, scaling)
    torch.testing.assert_close(short, _table(inv_frequencies(HEAD_DIM, 10000.0, scaling, 64),
                                             attention_factor(scaling), 64), atol=0, rtol=0)
    assert not torch.allclose(short, long[:64])
    # factor = 256 / 64 = 4: sqrt(1 + ln 4 / ln 64) scales both regimes.
    assert attention_factor(scaling) == pytest.approx(math.sqrt(1 + math.log(4) / math.log(64)))


def test_phi3_config_longrope_fields():
    """Phi3Config's own original_max_position_embeddings wins (default 4096); su / yarn mean longrope."""
    phi3 = {**BASE, "architectures": ["Phi3ForCausalLM"], "max_position_embeddings": 8192}
    scaling = {"short_factor": [1.0] * 8, "long_factor": [2.0] * 8}
    inner = {"original_max_position_embeddings": 32}  # loses to the config's own field
    for form, original in (({"rope_scaling": {"type": "longrope", **scaling}}, 4096),
                           ({"rope_scaling": {"type": "longrope", **scaling, **inner}}, 4096),
                           ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4, **scaling}},
                            4096),
                           ({"rope_scaling": {"type": "su", **scaling, **inner}}, 4096),
                           ({"rope_scaling": {"type": "longrope", **scaling},
                             "original_max_position_embeddings": 2048}, 2048)):
        config = ModelConfig.from_dict({**phi3, **form})
        assert config.rope_scaling["rope_type"] == "longrope"
        assert config.rope_scaling["original_max_position_embeddings"] == original
        assert config.rope_scaling["factor"] == 8192 / original
        ref = transformers.Phi3Config(**{k: v for k, v in phi3.items() if k != "architectures"}, **form)
        torch.testing.assert_close(inv_frequencies(HEAD_DIM, config.rope_theta, config.rope_scaling, 8192),
                                   _hf_init(ref, 8192)[0], atol=0, rtol=1e-6)
        assert attention_factor(config.rope_scaling) == pytest.approx(_hf_init(ref, 8192)[1], rel=1e-12)


def test_config_saved_by_transformers_round_trips(tmp_path):
    """A yarn config transformers 5 writes (rope_parameters with rope_theta inside) reads back the same."""
    case = CASES["yarn-mscale"](HEAD_DIM // 2)
    hf_config = _hf_config(case, 1.0)
    hf_config.architectures = ["LlamaForCausalLM"]
    hf_config.save_pretrained(tmp_path)
    ours = ModelConfig.from_dir(tmp_path)
    assert ours.rope_theta == THETA and ours.rope_scaling["rope_type"] == "yarn"
    torch.testing.assert_close(inv_frequencies(HEAD_DIM, ours.rope_theta, ours.rope_scaling),
                               _hf_init(hf_config)[0], atol=0, rtol=1e-6)


def test_nested_rope_parameters_pick_the_layer_type():
    nested = {**BASE, "rope_parameters": {
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}}
    config = ModelConfig.from_dict(nested)
    assert config.rope_theta == 1e6 and config.rope_scaling == {"rope_type": "linear", "factor": 8.0}


def test_rope_errors_are_clear():
    def parse(**fields):
        return ModelConfig.from_dict({**BASE, **fields})

    assert set(SUPPORTED_ROPE_TYPES) == set(ROPE_TYPES)
    with pytest.raises(ValueError, match=re.escape("rope scaling type 'mrope' is not supported; supported: "
                                                   "default, linear, dynamic, yarn, longrope, llama3")):
        parse(rope_scaling={"rope_type": "mrope", "factor": 2.0})
    with pytest.raises(ValueError, match="rope scaling 'dynamic' needs factor"):
        parse(rope_scaling={"type": "dynamic"})
    with pytest.raises(ValueError, match="rope scaling 'longrope' needs short_factor, long_factor"):
        parse(rope_scaling={"type": "longrope"})
    with pytest.raises(ValueError, match=r"long_factor has 3 entries; 8 expected \(rotary dimension 16 /"):
        parse(rope_scaling={"type": "longrope", "short_factor": [1.0] * 8, "long_factor": [1.0] * 3})
    with pytest.raises(ValueError, match="config: rope_parameters / rope_scaling must be an object"):
        parse(rope_scaling="yarn")
    with pytest.raises(ValueError, match="short_factor must be a list of numbers"):
        parse(rope_scaling={"type": "longrope", "short_factor": "1", "long_factor": [1.0] * 8})
    assert parse(partial_rotary_factor=0.3).rotary_dim == 4  # int(16 * 0.3), as transformers rounds
    with pytest.raises(ValueError, match="partial_rotary_factor 0.2 gives 3 rotary channels"):
        parse(partial_rotary_factor=0.2)
    with pytest.raises(ValueError, match="rope scaling type 'bogus' is not supported"):
        inv_frequencies(16, 10000.0, {"rope_type": "bogus"})
    with pytest.raises(ValueError, match="rotary dimension must be even"):
        cos_sin_cache(8, 7, 10000.0)


# --- whole models ------------------------------------------------------------------------------

YARN = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}  # 4.x form in config.json


@pytest.mark.parametrize("architecture,scaling", [
    ("Qwen2ForCausalLM", YARN),
    ("LlamaForCausalLM", {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32,
                          "mscale": 0.707, "mscale_all_dim": 1.0}),
    ("LlamaForCausalLM", {"rope_type": "dynamic", "factor": 2.0}),
], ids=["qwen2-yarn", "llama-yarn-mscale", "llama-dynamic"])
def test_scaled_model_logits_match_transformers(tmp_path, architecture, scaling):
    model_dir = make_tiny_model(tmp_path / "m", architecture, rope_scaling=scaling)
    ours = check_against_transformers(model_dir, lengths=[70, 3], decode_steps=2)
    assert ours.config.rope_scaling["rope_type"] == scaling.get("rope_type", scaling.get("type"))


@pytest.mark.slow
def test_yarn_qwen2_greedy_matches_transformers(tmp_path):
    """Chunked prefill, preemption and prefix caching on a YaRN model: transformers' greedy tokens."""
    model_dir = make_tiny_model(tmp_path / "qwen2-yarn", "Qwen2ForCausalLM", rope_scaling=YARN)
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(3)
    prefix = torch.randint(0, 300, (32,), generator=gen).tolist()
    prompts = [torch.randint(0, 300, (n,), generator=gen).tolist() for n in (5, 40, 100, 150)]
    prompts += [prefix + torch.randint(0, 300, (n,), generator=gen).tolist() for n in (3, 50)]
    with torch.no_grad():
        refs = [hf_greedy(hf, p, 12) for p in prompts]
    llm = LLM(model_dir, num_kv_blocks=16, max_num_batched_tokens=48, max_num_seqs=8)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert llm.engine.num_preemptions > 0 and llm.engine.block_manager.num_hit_tokens > 0
    for i, (out, (tokens, logits)) in enumerate(zip(outs, refs, strict=True)):
        assert out.outputs[0].token_ids == tokens, f"prompt {i}"
        lp = out.outputs[0].logprobs[-1]
        ref = torch.log_softmax(logits[-1], dim=-1)
        assert torch.allclose(torch.tensor([lp[t].logprob for t in lp]), ref[list(lp)], atol=ATOL, rtol=0)
