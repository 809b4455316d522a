"""MoE checkpoints (Mixtral, Qwen2-MoE, Qwen3-MoE) against transformers: greedy tokens identical and
logits within 1e-4 under chunked prefill, preemption and prefix caching — the checks of
tests/test_llm_vs_transformers.py, run on tiny random checkpoints that transformers itself wrote
(tests/moe_models.py: hidden 64, 2 layers, 4 experts, top-2)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import test_llm_vs_transformers as vs_hf  # noqa: E402
import transformers  # noqa: E402
from moe_models import ARCHITECTURES, make_tiny_moe_model  # noqa: E402

from batchinfer.workers.models.loader import load_model  # noqa: E402
from batchinfer.workers.models.model_config import ModelConfig  # noqa: E402
from batchinfer.workers.models.moe import SparseMoeBlock  # noqa: E402


@pytest.fixture(scope="module", params=list(ARCHITECTURES))
def moe_refs(request, tmp_path_factory):
    path = make_tiny_moe_model(tmp_path_factory.mktemp("models") / request.param, request.param)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts, max_tokens = vs_hf.workload()
    with torch.no_grad():
        refs = [vs_hf.hf_greedy(hf, p, n) for p, n in zip(prompts, max_tokens, strict=True)]
    return path, prompts, max_tokens, refs


@pytest.mark.slow  # ~10-15 s per architecture and mode on 2 cores, like the dense architectures' runs
@pytest.mark.parametrize("prefix_caching", [True, False], ids=["prefix-cache", "no-prefix-cache"])
def test_moe_greedy_matches_transformers(moe_refs, prefix_caching):
    vs_hf.test_greedy_matches_transformers(moe_refs, prefix_caching)


def test_moe_final_step_logits_within_tolerance(moe_refs):
    vs_hf.test_final_step_logits_within_tolerance(moe_refs)


def test_moe_layers_and_routing_fields_follow_transformers(tmp_path):
    mixtral = ModelConfig.from_dir(make_tiny_moe_model(tmp_path / "m", "MixtralForCausalLM"))
    assert (mixtral.num_experts, mixtral.num_experts_per_tok, mixtral.moe_intermediate_size) == (4, 2, 96)
    assert mixtral.norm_topk_prob and mixtral.moe_layers == (0, 1)
    assert not mixtral.shared_expert_intermediate_size
    qwen2 = ModelConfig.from_dir(make_tiny_moe_model(tmp_path / "q2", "Qwen2MoeForCausalLM",
                                                     num_hidden_layers=4, decoder_sparse_step=2))
    assert qwen2.moe_layers == (1, 3) and not qwen2.norm_topk_prob and qwen2.qkv_bias and not qwen2.o_bias
    assert qwen2.shared_expert_intermediate_size == 80 and qwen2.moe_intermediate_size == 48
    qwen3 = ModelConfig.from_dir(make_tiny_moe_model(tmp_path / "q3", "Qwen3MoeForCausalLM"))
    assert qwen3.moe_layers == (0,) and qwen3.norm_topk_prob and qwen3.qk_norm
    assert qwen3.sliding_window is None
    model = load_model(tmp_path / "q3")
    assert isinstance(model.layers[0].mlp, SparseMoeBlock)
    assert not isinstance(model.layers[1].mlp, SparseMoeBlock)


def test_expert_weights_are_stacked_in_checkpoint_order(tmp_path):
    """Slice e of w13 is expert e's [gate; up] and slice e of w2 its down projection."""
    from safetensors.torch import load_file

    path = make_tiny_moe_model(tmp_path / "m", "MixtralForCausalLM")
    tensors = load_file(str(path / "model.safetensors"))
    block = load_model(path).layers[1].mlp
    assert isinstance(block, SparseMoeBlock)
    p = "model.layers.1.block_sparse_moe."
    for e in range(4):
        expected = torch.cat([tensors[p + f"experts.{e}.w1.weight"], tensors[p + f"experts.{e}.w3.weight"]])
        assert torch.equal(block.w13[e], expected)
        assert torch.equal(block.w2[e], tensors[p + f"experts.{e}.w2.weight"])
    assert torch.equal(block.gate.weight, tensors[p + "gate.weight"])


def test_bad_moe_checkpoints_raise_clear_errors(tmp_path):
    from safetensors.torch import load_file, save_file

    path = make_tiny_moe_model(tmp_path / "m", "MixtralForCausalLM")
    tensors = load_file(str(path / "model.safetensors"))
    missing = {k: v for k, v in tensors.items() if "experts.3.w3" not in k}
    save_file(missing, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"lacks tensors for .*mlp\.w13 \(3\.up part\)"):
        load_model(path)
    extra = dict(tensors, **{"model.layers.0.block_sparse_moe.experts.7.w1.weight": tensors[
        "model.layers.0.block_sparse_moe.experts.0.w1.weight"].clone()})
    save_file(extra, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"part '7\.gate' has no place"):
        load_model(path)
    base = {"architectures": ["Qwen2MoeForCausalLM"], "vocab_size": 320, "hidden_size": 64,
            "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4, "num_experts": 4,
            "num_experts_per_tok": 2, "moe_intermediate_size": 48}
    with pytest.raises(ValueError, match="shared_expert_intermediate_size"):
        ModelConfig.from_dict(base)
    with pytest.raises(ValueError, match="num_experts_per_tok 5 must be in 1..4"):
        ModelConfig.from_dict({**base, "shared_expert_intermediate_size": 8, "num_experts_per_tok": 5})
