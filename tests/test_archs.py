"""The architecture table (workers/models/archs.py): each spec's ``model_type`` is the family
transformers maps to that architecture, and the defaults are Llama's reading."""

from __future__ import annotations

import pytest

from batchinfer.workers.models.archs import ARCHITECTURES, ArchSpec
from batchinfer.workers.models.model_config import SUPPORTED_ARCHITECTURES, ModelConfig

transformers = pytest.importorskip("transformers")
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES  # noqa: E402

BASE = {"vocab_size": 100, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
        "num_attention_heads": 4}


@pytest.mark.parametrize("arch", SUPPORTED_ARCHITECTURES)
def test_model_type_is_transformers_family(arch):
    assert MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[ARCHITECTURES[arch].model_type] == arch


@pytest.mark.parametrize("arch", SUPPORTED_ARCHITECTURES)
def test_model_type_alone_picks_the_architecture(arch):
    extra = {"num_experts": 4, "num_local_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
             "shared_expert_intermediate_size": 64}
    config = ModelConfig.from_dict({**BASE, **extra, "model_type": ARCHITECTURES[arch].model_type})
    assert config.architecture == arch


def test_defaults_are_llamas_and_gemma_layer_rules():
    """The defaults are Llama's reading: a spec of defaults gives a plain Llama-shaped config."""
    llama = ModelConfig.from_dict({**BASE, "model_type": "llama", "attention_bias": True})
    assert ARCHITECTURES["LlamaForCausalLM"] == ArchSpec("llama")
    assert (llama.qkv_bias, llama.o_bias, llama.qk_norm, llama.hidden_act) == (True, True, False, "silu")
    assert not (llama.norm_unit_offset or llama.sandwich_norms or llama.scale_embeddings)
    assert llama.attn_logit_softcapping is None and llama.num_experts == 0
    gemma3 = ModelConfig.from_dict({**BASE, "model_type": "gemma3_text", "sliding_window": 8})
    assert gemma3.layer_types == ("sliding_attention",) * 4  # every 6th layer is global
    assert gemma3.attn_logit_softcapping is None and gemma3.final_logit_softcapping is None
    gemma2 = ModelConfig.from_dict({**BASE, "model_type": "gemma2", "sliding_window": 8})
    assert gemma2.layer_types == ("sliding_attention", "full_attention") * 2
    assert (gemma2.attn_logit_softcapping, gemma2.final_logit_softcapping) == (50.0, 30.0)
    assert gemma2.tie_word_embeddings and gemma2.query_pre_attn_scalar == 256.0
