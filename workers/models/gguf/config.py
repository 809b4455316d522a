"""GGUF metadata -> a Hugging Face style ``config.json`` dictionary (and a generation config).

``ModelConfig.from_dict`` then reads it exactly as it reads a checkpoint's ``config.json``, so one
code path decides what the decoder supports. Keys are ``<general.architecture>.<suffix>``; an
architecture llama.cpp names differently from transformers is one row of ``ARCHITECTURES``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from batchinfer.workers.models.gguf.reader import GGUFFile

# general.architecture -> (Hugging Face architecture, model_type).
ARCHITECTURES: dict[str, tuple[str, str]] = {
    "llama": ("LlamaForCausalLM", "llama"),
    "mistral": ("MistralForCausalLM", "mistral"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "gemma2": ("Gemma2ForCausalLM", "gemma2"),
}
# <arch>.<suffix> -> config.json key.
_KEYS = {
    "block_count": "num_hidden_layers",
    "embedding_length": "hidden_size",
    "feed_forward_length": "intermediate_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.key_length": "head_dim",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "context_length": "max_position_embeddings",
    "rope.freq_base": "rope_theta",
    "attention.sliding_window": "sliding_window",
    "attn_logit_softcapping": "attn_logit_softcapping",  # Gemma 2
    "final_logit_softcapping": "final_logit_softcapping",
}


def hf_config(f: GGUFFile) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(config, generation_config)`` dictionaries for GGUF checkpoint ``f``.

    ``ValueError`` names an architecture without a row in ``ARCHITECTURES`` (listing those that
    have one) and per-layer values that differ between layers (not supported).
    """
    arch = f.architecture
    if arch not in ARCHITECTURES:
        raise ValueError(f"{f.path.name}: GGUF architecture {arch!r} is not supported; supported: "
                         f"{', '.join(ARCHITECTURES)}")
    if "rope_freqs.weight" in f.tensors:
        raise ValueError(f"{f.path.name}: per-frequency RoPE factors (rope_freqs.weight, Llama 3.1's "
                         "llama3 scaling) are not supported for GGUF files yet; convert the Hugging "
                         "Face checkpoint instead")
    hf_arch, model_type = ARCHITECTURES[arch]
    config: dict[str, Any] = {"architectures": [hf_arch], "model_type": model_type}
    for suffix, key in _KEYS.items():
        value = f.arch_get(suffix)
        if value is not None:
            config[key] = _one(value, f"{arch}.{suffix}", f)
    value_length = f.arch_get("attention.value_length")
    if value_length is not None and value_length != config.get("head_dim", value_length):
        raise ValueError(f"{f.path.name}: key_length {config['head_dim']} != value_length {value_length} "
                         "is not supported")
    config["vocab_size"] = _vocab_size(f)
    rope_scaling = _rope_scaling(f)
    if rope_scaling:
        config["rope_scaling"] = rope_scaling
    if config.get("sliding_window") is not None:
        if hf_arch == "LlamaForCausalLM":  # llama.cpp writes Mistral as llama: the window tells them apart
            config["architectures"], config["model_type"] = ["MistralForCausalLM"], "mistral"
        config["use_sliding_window"] = True
    if hf_arch == "Gemma2ForCausalLM":
        config["query_pre_attn_scalar"] = _gemma2_query_scalar(config)
    # Tensors decide what the metadata does not say: tied embeddings, biases.
    config["tie_word_embeddings"] = "output.weight" not in f.tensors
    config["attention_bias"] = "blk.0.attn_q.bias" in f.tensors
    config["mlp_bias"] = "blk.0.ffn_up.bias" in f.tensors
    bos, eos = f.get("tokenizer.ggml.bos_token_id"), f.get("tokenizer.ggml.eos_token_id")
    if bos is not None:
        config["bos_token_id"] = int(bos)
    if eos is not None:
        config["eos_token_id"] = int(eos)
    # End of turn (chat models' <|im_end|> ...) ends generation too, as in llama.cpp.
    eot = f.get("tokenizer.ggml.eot_token_id")
    generation = {"eos_token_id": [int(t) for t in (eos, eot) if t is not None]}
    return config, generation


def _gemma2_query_scalar(config: dict[str, Any]) -> int:
    """Gemma 2's attention scale, which GGUF does not store: llama.cpp's rule (head_dim; the 46-layer
    27B scales by hidden_size / heads, its query_pre_attn_scalar of 144)."""
    heads = config["num_attention_heads"]
    if config.get("num_hidden_layers") == 46:
        return int(config["hidden_size"] // heads)
    return int(config.get("head_dim") or config["hidden_size"] // heads)


def _one(value: Any, key: str, f: GGUFFile) -> Any:
    """A per-model value; a per-layer list only when every layer has the same value."""
    if isinstance(value, list):
        if not value or any(v != value[0] for v in value):
            raise ValueError(f"{f.path.name}: {key} differs between layers ({value[:8]}...); not supported")
        value = value[0]
    return _decimal(value) if isinstance(value, float) else value


def _decimal(value: float) -> float:
    """A float32 field as the decimal it was written from (1e-05, not 9.999999747378752e-06)."""
    return float(str(np.float32(value)))


def _vocab_size(f: GGUFFile) -> int:
    tokens = f.reader.fields.get("tokenizer.ggml.tokens")
    if tokens is not None:
        return len(tokens.data)  # one entry per string: no need to decode 50k strings
    if f.arch_get("vocab_size") is not None:
        return int(f.arch_get("vocab_size"))
    embd = f.tensors.get("token_embd.weight")
    if embd is None:
        raise ValueError(f"{f.path.name}: no token list, vocab_size or token_embd.weight "
                         "to size the vocabulary")
    return int(embd.shape[-1])


def _rope_scaling(f: GGUFFile) -> dict[str, Any] | None:
    """``<arch>.rope.scaling.*`` as a config.json ``rope_scaling`` (None: plain RoPE)."""
    kind = f.arch_get("rope.scaling.type")
    factor = f.arch_get("rope.scaling.factor")
    if kind in (None, "none") and not factor:
        return None
    if kind in (None, "none"):
        kind = "linear"  # older files give only a factor (llama.cpp's rope_freq_scale = 1 / factor)
    scaling: dict[str, Any] = {"rope_type": str(kind), "factor": _decimal(float(factor or 1.0))}
    original = f.arch_get("rope.scaling.original_context_length")
    if original is not None:
        scaling["original_max_position_embeddings"] = int(original)
    for suffix, key in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow"),
                        ("attn_factor", "attention_factor")):
        value = f.arch_get(f"rope.scaling.{suffix}")
        if value is not None:
            scaling[key] = _decimal(float(value))
    return scaling
