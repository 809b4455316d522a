"""GGUF files of the non-llama families (Gemma 2 / 3, Phi-3, Qwen2-MoE, Qwen3-MoE, Mixtral): written
by ``write_gguf`` the way llama.cpp's converter lays them out, then checked two ways:

- exact: our load of the F32 file equals our load of the HF folder it came from (every parameter,
  every config field), on checkpoints that use each feature the metadata carries;
- against transformers' own GGUF loading (``from_pretrained(dir, gguf_file=...)``): greedy tokens
  and final-step logprobs, F16 and Q8_0. transformers' GGUF config reads fewer keys than llama.cpp
  writes (see each maker), so those checkpoints use transformers' defaults for the rest.

transformers has no Mixtral GGUF path (llama.cpp writes Mixtral as ``llama``; transformers builds a
dense Llama from it), so Mixtral is checked against our HF-folder load, itself checked against
transformers in tests/test_moe.py.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

from gguf_helpers import assert_matches_transformers, assert_same_model, gguf_folder, prompts  # noqa: E402
from gguf_writer import write_gguf  # noqa: E402
from moe_models import make_tiny_moe_model  # noqa: E402
from test_gemma import make_gemma  # noqa: E402
from test_phi3 import make_tiny_phi3  # noqa: E402

from batchinfer.workers.models import load_model  # noqa: E402
from batchinfer.workers.models.gguf import GGUFFile, dequantize  # noqa: E402

pytestmark = pytest.mark.slow  # transformers' eager generate dominates
Q = gguf.GGMLQuantizationType
QTYPES = [Q.F16, Q.Q8_0]
# transformers' GGUF config reads neither soft-cap nor query_pre_attn_scalar (its defaults: 50, 30,
# 256), so the tiny Gemma 2 uses those values (head_dim 256 = llama.cpp's scale rule) to build the
# same model on both sides.
GEMMA2 = dict(head_dim=256, query_pre_attn_scalar=256, attn_logit_softcapping=50.0,
              final_logit_softcapping=30.0)
# Gemma 3 for transformers: its defaults for what its GGUF config skips (query_pre_attn_scalar 256,
# local RoPE base 10000, every sixth layer global, no final cap); 6 layers, so one is global.
GEMMA3_HF = dict(num_hidden_layers=6, head_dim=256, query_pre_attn_scalar=256, final_logit_softcapping=None,
                 layer_types=["sliding_attention"] * 5 + ["full_attention"],
                 rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                  "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})
# Gemma 3 for the exact check: linear-scaled global RoPE, a local base off llama.cpp's 10000, layers
# S F S (not llama.cpp's every-sixth pattern), a final cap, llama.cpp's scale rule at head_dim 16.
GEMMA3_EXACT = dict(query_pre_attn_scalar=16, final_logit_softcapping=5.0, rope_parameters={
    "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
    "sliding_attention": {"rope_type": "default", "rope_theta": 20000.0}})
# Phi-3 for transformers, whose GGUF config reads no rotary share, LongRoPE factors or window.
PHI3_HF = dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
# MoE for transformers, whose GGUF config reads no expert sizes: its defaults (Qwen2-MoE 1408 /
# 5632, Qwen3-MoE 768), every layer routed.
MOE_HF = {"Qwen2MoeForCausalLM": dict(moe_intermediate_size=1408, shared_expert_intermediate_size=5632),
          "Qwen3MoeForCausalLM": dict(moe_intermediate_size=768, mlp_only_layers=[])}


def _gemma2_gguf(tmp_path, qtype):
    hf, _ = make_gemma(tmp_path / "hf", "gemma2", **GEMMA2)
    return hf, gguf_folder(hf, tmp_path / f"gguf-{qtype.name}", qtype)


def test_gemma2_f32_gguf_is_the_checkpoint(tmp_path):
    # Sandwich-norm names, the +1 llama.cpp adds to Gemma's norms undone, tied head, config fields.
    hf, folder = _gemma2_gguf(tmp_path, Q.F32)
    f = GGUFFile(folder)
    assert "blk.0.post_ffw_norm.weight" in f.tensors and "output.weight" not in f.tensors
    skip = frozenset({"torch_dtype", "eos_token_ids", "max_position_embeddings"})
    config = assert_same_model(folder / "m.gguf", hf, atol=1e-6, skip=skip)
    assert config.attn_logit_softcapping == 50.0 and config.final_logit_softcapping == 30.0
    assert config.layer_sliding_window(0) == 8 and config.layer_sliding_window(1) is None


@pytest.mark.parametrize("qtype", QTYPES, ids=lambda t: t.name)
def test_gemma2_gguf_matches_transformers_gguf(tmp_path, qtype):
    _, folder = _gemma2_gguf(tmp_path, qtype)
    assert_matches_transformers(folder, prompts()[:4])  # up to 40 tokens: past the sliding window of 8


def test_gemma3_f32_gguf_is_the_checkpoint(tmp_path):
    hf, _ = make_gemma(tmp_path / "hf", "gemma3", **GEMMA3_EXACT)
    folder = gguf_folder(hf, tmp_path / "gguf", Q.F32)
    f = GGUFFile(folder)
    assert f.arch_get("rope.freq_base") == 1e6 and f.arch_get("rope.freq_base_swa") == 20000.0
    assert f.arch_get("attention.sliding_window_pattern") == [True, False, True]
    skip = frozenset({"torch_dtype", "eos_token_ids", "max_position_embeddings"})
    config = assert_same_model(folder / "m.gguf", hf, atol=1e-6, skip=skip)
    assert config.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert config.rope_local_theta == 20000.0
    assert config.layer_types == ("sliding_attention", "full_attention", "sliding_attention")
    assert config.qk_norm and config.query_pre_attn_scalar == 16 and config.final_logit_softcapping == 5.0


@pytest.mark.parametrize("qtype", QTYPES, ids=lambda t: t.name)
def test_gemma3_gguf_matches_transformers_gguf(tmp_path, qtype):
    hf, _ = make_gemma(tmp_path / "hf", "gemma3", **GEMMA3_HF)
    folder = gguf_folder(hf, tmp_path / "gguf", qtype)
    f = GGUFFile(folder)  # llama.cpp's defaults: no local base, no pattern key in the file
    assert f.arch_get("rope.freq_base_swa") is None and f.arch_get("attention.sliding_window_pattern") is None
    config = load_model(folder, progress=False).config
    assert [config.layer_sliding_window(i) for i in range(6)] == [8] * 5 + [None]
    assert config.rope_local_theta == 10000.0 and config.rope_theta == 1e6
    assert_matches_transformers(folder, prompts()[:3])  # up to 17 tokens: past the window of 8


def test_gemma3_scale_off_llama_cpp_rule_is_refused(tmp_path):
    hf, _ = make_gemma(tmp_path / "hf", "gemma3", query_pre_attn_scalar=24)
    with pytest.raises(ValueError, match=r"query_pre_attn_scalar 24 is not llama.cpp's rule \(16\)"):
        write_gguf(hf, tmp_path / "m.gguf")


def test_phi3_f32_gguf_is_the_checkpoint(tmp_path):
    # Fused qkv / gate_up, LongRoPE factors, partial rotary (8 of 16), a window of 80.
    hf = make_tiny_phi3(tmp_path / "hf", 512, sliding_window=80)
    folder = gguf_folder(hf, tmp_path / "gguf", Q.F32)
    f = GGUFFile(folder)  # LongRoPE factors as tensors
    names = {"blk.0.attn_qkv.weight", "rope_factors_long.weight", "rope_factors_short.weight"}
    assert names <= set(f.tensors)
    assert "blk.0.ffn_gate.weight" not in f.tensors and f.arch_get("rope.dimension_count") == 8
    config = assert_same_model(folder / "m.gguf", hf)
    assert config.partial_rotary_factor == 0.5 and config.layer_sliding_window(0) == 80
    assert config.rope_scaling["rope_type"] == "longrope"
    assert config.rope_scaling["original_max_position_embeddings"] == 32


@pytest.mark.parametrize("qtype", QTYPES, ids=lambda t: t.name)
def test_phi3_gguf_matches_transformers_gguf(tmp_path, qtype):
    hf = make_tiny_phi3(tmp_path / "hf", 512, **PHI3_HF)
    folder = gguf_folder(hf, tmp_path / "gguf", qtype)
    assert GGUFFile(folder).arch_get("attention.sliding_window") == 0  # llama.cpp's "no window"
    assert load_model(folder, progress=False).config.layer_sliding_window(0) is None
    assert_matches_transformers(folder, prompts())


@pytest.mark.parametrize("arch", ["MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"])
def test_moe_f32_gguf_is_the_checkpoint(tmp_path, arch):
    # Stacked experts split back, routers, Qwen2-MoE's shared expert and its [C] gate, Qwen3-MoE's
    # dense layer 1 (mlp_only_layers), Mixtral's q/k permutation.
    hf = make_tiny_moe_model(tmp_path / "hf", arch)
    folder = gguf_folder(hf, tmp_path / "gguf", Q.F32)
    f = GGUFFile(folder)
    assert tuple(reversed(f.tensors["blk.0.ffn_gate_exps.weight"].shape.tolist()))[0] == 4  # [E, I, C]
    config = assert_same_model(folder / "m.gguf", hf)
    assert config.architecture == arch and config.num_experts == 4
    assert config.moe_layers == ((0,) if arch == "Qwen3MoeForCausalLM" else (0, 1))


def test_mixtral_quantized_experts_are_gguf_numpy_dequantized(tmp_path):
    # transformers cannot load a Mixtral GGUF: our experts are gguf's own dequantization, sliced.
    hf = make_tiny_moe_model(tmp_path / "hf", "MixtralForCausalLM")
    folder = gguf_folder(hf, tmp_path / "gguf", Q.Q8_0)
    f = GGUFFile(folder)
    t = f.tensors["blk.1.ffn_down_exps.weight"]
    assert t.tensor_type == Q.Q8_0
    ref = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
    ref = torch.from_numpy(ref.reshape(tuple(reversed(t.shape.tolist()))))  # [E, C, I]
    model = load_model(folder, progress=False)
    torch.testing.assert_close(dequantize(t), ref, rtol=0, atol=0)
    torch.testing.assert_close(dict(model.named_parameters())["layers.1.mlp.w2"], ref, rtol=0, atol=0)
    assert f.tensors["blk.1.ffn_gate_inp.weight"].tensor_type == Q.F32  # routers stay F32, as in llama.cpp


def test_mixtral_gguf_with_one_tensor_per_expert_loads(tmp_path):
    # llama.cpp's Mixtral files of early 2024 hold blk.N.ffn_gate.E.weight, not ffn_gate_exps.
    hf = make_tiny_moe_model(tmp_path / "hf", "MixtralForCausalLM")
    stacked = GGUFFile(gguf_folder(hf, tmp_path / "gguf", Q.F32))
    legacy = tmp_path / "legacy" / "m.gguf"
    legacy.parent.mkdir()
    w = gguf.GGUFWriter(str(legacy), "llama")
    for key, field in stacked.reader.fields.items():
        if key.startswith(("llama.", "tokenizer.")):  # the writer adds general.architecture itself
            sub = field.types[-1] if len(field.types) > 1 else None
            w.add_key_value(key, field.contents(), field.types[0], sub)
    for t in stacked.tensors.values():
        x = dequantize(t).numpy()
        match = re.fullmatch(r"(blk\.\d+\.ffn_\w+)_exps\.weight", t.name)
        for e in range(x.shape[0]) if match else ():
            w.add_tensor(f"{match.group(1)}.{e}.weight", x[e])
        if not match:
            w.add_tensor(t.name, x)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert "blk.0.ffn_gate.3.weight" in GGUFFile(legacy).tensors
    assert_same_model(legacy, hf)


@pytest.mark.parametrize("qtype", QTYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("arch", ["Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"])
def test_qwen_moe_gguf_matches_transformers_gguf(tmp_path, arch, qtype):
    hf = make_tiny_moe_model(tmp_path / "hf", arch, **MOE_HF[arch])
    folder = gguf_folder(hf, tmp_path / "gguf", qtype)
    assert_matches_transformers(folder, prompts())
