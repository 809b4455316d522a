"""GGUF metadata -> a Hugging Face style ``config.json`` dictionary (and a generation config).

``ModelConfig.from_dict`` then reads it exactly as it reads a checkpoint's ``config.json``, so one
code path decides what the decoder supports. Keys are ``<general.architecture>.<suffix>``; an
architecture llama.cpp names differently from transformers is one row of ``ARCHITECTURES``.
What the metadata leaves out is llama.cpp's own rule (Gemma's attention scale, Gemma 3's local
RoPE base and every-sixth-layer-global pattern, Qwen-MoE's top-k renormalisation) or is read from
the tensors (tied head, biases, MoE sizes, Phi-3's LongRoPE factors).
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
    "gemma3": ("Gemma3ForCausalLM", "gemma3_text"),
    "phi3": ("Phi3ForCausalLM", "phi3"),
    "qwen2moe": ("Qwen2MoeForCausalLM", "qwen2_moe"),
    "qwen3moe": ("Qwen3MoeForCausalLM", "qwen3_moe"),
}
# llama.cpp writes Mixtral as `llama` with llama.expert_count > 0.
MIXTRAL = ("MixtralForCausalLM", "mixtral")
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
    "expert_used_count": "num_experts_per_tok",  # mixture of experts
    "expert_feed_forward_length": "moe_intermediate_size",
    "expert_shared_feed_forward_length": "shared_expert_intermediate_size",
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
    if arch == "llama" and (f.arch_get("expert_count") or 0) > 0:
        hf_arch, model_type = MIXTRAL
    config: dict[str, Any] = {"architectures": [hf_arch], "model_type": model_type}
    for suffix, key in _KEYS.items():
        value = f.arch_get(suffix)
        if value is not None:
            config[key] = _one(value, f"{arch}.{suffix}", f)
    value_length = f.arch_get("attention.value_length")
    if value_length is not None and value_length != config.get("head_dim", value_length):
        raise ValueError(f"{f.path.name}: key_length {config['head_dim']} != value_length {value_length} "
                         "is not supported")
    if hf_arch == "Phi3ForCausalLM" and not config.get("sliding_window"):
        config["sliding_window"] = None  # llama.cpp writes 0 for "no window" (Phi-4)
    config["vocab_size"] = _vocab_size(f)
    _check_rope_dims(f, config, hf_arch)
    rope_scaling = _rope_scaling(f)
    if rope_scaling:
        config["rope_scaling"] = rope_scaling
    if config.get("sliding_window") is not None:
        if hf_arch == "LlamaForCausalLM":  # llama.cpp writes Mistral as llama: the window tells them apart
            config["architectures"], config["model_type"] = ["MistralForCausalLM"], "mistral"
        config["use_sliding_window"] = True
    if hf_arch in ("Gemma2ForCausalLM", "Gemma3ForCausalLM"):
        config["query_pre_attn_scalar"] = gemma_query_scalar(config, hf_arch)
    if hf_arch == "Gemma3ForCausalLM":
        config.update(_gemma3_fields(f, config))
    if hf_arch == "Phi3ForCausalLM":
        config.update(_phi3_fields(f, config))
    if hf_arch in ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"):
        config.update(_moe_fields(f, config, hf_arch))
    # Tensors decide what the metadata does not say: tied embeddings, biases.
    config["tie_word_embeddings"] = "output.weight" not in f.tensors
    config["attention_bias"] = "blk.0.attn_q.bias" in f.tensors
    config["qkv_bias"] = config["attention_bias"] or "blk.0.attn_qkv.bias" in f.tensors  # Qwen2-MoE
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


# Gemma's 27B models scale attention by hidden_size / heads, the others by head_dim (llama.cpp's
# rule, keyed on the layer count: Gemma 2 27B has 46 layers, Gemma 3 27B 62).
_GEMMA_27B_LAYERS = {"Gemma2ForCausalLM": 46, "Gemma3ForCausalLM": 62}
GEMMA3_SLIDING_PATTERN = 6  # llama.cpp: every sixth Gemma 3 layer is global
GEMMA3_LOCAL_ROPE_BASE = 10000.0  # llama.cpp: Gemma 3's sliding layers, unless rope.freq_base_swa says


def gemma_query_scalar(config: dict[str, Any], arch: str) -> int:
    """Gemma's ``query_pre_attn_scalar`` as llama.cpp derives it: GGUF has no key for it (llama.cpp
    overrides even ``attention.scale`` for Gemma), so ``write_gguf`` refuses a checkpoint off the rule."""
    heads = config["num_attention_heads"]
    if config.get("num_hidden_layers") == _GEMMA_27B_LAYERS[arch]:
        return int(config["hidden_size"] // heads)
    return int(config.get("head_dim") or config["hidden_size"] // heads)


def _gemma3_fields(f: GGUFFile, config: dict[str, Any]) -> dict[str, Any]:
    """Gemma 3's local RoPE base and which layers slide (``attention.sliding_window_pattern``: a
    period, or one bool per layer, true = sliding; llama.cpp's default period is 6)."""
    layers = int(config["num_hidden_layers"])
    fields: dict[str, Any] = {
        "rope_local_base_freq": _decimal(float(f.arch_get("rope.freq_base_swa") or GEMMA3_LOCAL_ROPE_BASE))}
    pattern = f.arch_get("attention.sliding_window_pattern")
    if isinstance(pattern, list):
        if len(pattern) != layers:
            raise ValueError(f"{f.path.name}: gemma3.attention.sliding_window_pattern has {len(pattern)} "
                             f"entries for {layers} layers")
        sliding = [bool(x) for x in pattern]
    else:
        period = int(pattern or GEMMA3_SLIDING_PATTERN)
        sliding = [(i + 1) % period != 0 for i in range(layers)]
    fields["layer_types"] = ["sliding_attention" if s else "full_attention" for s in sliding]
    return fields


def _phi3_fields(f: GGUFFile, config: dict[str, Any]) -> dict[str, Any]:
    """Phi-3's partial rotary (rope.dimension_count of head_dim), original context and LongRoPE
    factors, which llama.cpp stores as the tensors rope_factors_long / rope_factors_short."""
    head_dim = int(config["hidden_size"]) // int(config["num_attention_heads"])
    fields: dict[str, Any] = {}
    dims = f.arch_get("rope.dimension_count")
    if dims is not None and int(dims) != head_dim:
        fields["partial_rotary_factor"] = int(dims) / head_dim
    original = f.arch_get("rope.scaling.original_context_length")
    if original is not None:
        fields["original_max_position_embeddings"] = int(original)
    long, short = (f.tensors.get(f"rope_factors_{k}.weight") for k in ("long", "short"))
    if (long is None) != (short is None):
        raise ValueError(f"{f.path.name}: LongRoPE needs both rope_factors_long and rope_factors_short")
    if long is not None and short is not None:
        # The rope.scaling.attn_factor llama.cpp writes is the one transformers derives from the factor.
        fields["rope_scaling"] = {"rope_type": "longrope",
                                  "long_factor": [_decimal(float(x)) for x in _values(long)],
                                  "short_factor": [_decimal(float(x)) for x in _values(short)]}
    return fields


def _values(t: Any) -> np.ndarray:
    if int(t.tensor_type) != 0:  # GGMLQuantizationType.F32: llama.cpp writes these as F32
        raise ValueError(f"{t.name}: expected an F32 tensor")
    return np.asarray(t.data, dtype=np.float32).reshape(-1)


def _moe_fields(f: GGUFFile, config: dict[str, Any], arch: str) -> dict[str, Any]:
    """Expert count and sizes (the stacked tensors' shapes where the metadata is silent, as llama.cpp
    falls back), which layers route (those with a router ``ffn_gate_inp``) and top-k renormalisation:
    llama.cpp renormalises Mixtral and Qwen3-MoE, not Qwen2-MoE, unless expert_weights_norm says."""
    experts = int(f.arch_get("expert_count") or 0)
    layers = int(config["num_hidden_layers"])
    routed = [i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" in f.tensors]
    if not experts or not routed:
        raise ValueError(f"{f.path.name}: a {arch} file needs {f.architecture}.expert_count > 0 and "
                         "router tensors blk.N.ffn_gate_inp")
    fields: dict[str, Any] = {"num_local_experts" if arch == "MixtralForCausalLM" else "num_experts": experts}
    first = routed[0]
    if arch == "MixtralForCausalLM":
        if len(routed) != layers:
            raise ValueError(f"{f.path.name}: Mixtral routes in every layer; layers "
                             f"{sorted(set(range(layers)) - set(routed))} have no ffn_gate_inp")
        return fields
    if config.get("moe_intermediate_size") is None:
        fields["moe_intermediate_size"] = _rows(f, f"blk.{first}.ffn_gate_exps.weight")
    shared = f"blk.{first}.ffn_gate_shexp.weight"
    if shared in f.tensors and config.get("shared_expert_intermediate_size") is None:
        fields["shared_expert_intermediate_size"] = _rows(f, shared)
    if arch == "Qwen2MoeForCausalLM" and shared not in f.tensors:
        raise ValueError(f"{f.path.name}: a qwen2moe file needs the shared expert (ffn_*_shexp tensors)")
    norm = f.arch_get("expert_weights_norm")
    fields["norm_topk_prob"] = bool(norm) if norm is not None else arch == "Qwen3MoeForCausalLM"
    fields["decoder_sparse_step"] = 1
    fields["mlp_only_layers"] = [i for i in range(layers) if i not in routed]
    return fields


def _rows(f: GGUFFile, name: str) -> int:
    """Rows of one expert's matrix: ggml's ne[1] (shape is in ggml order: columns first)."""
    if name not in f.tensors:
        raise ValueError(f"{f.path.name}: tensor {name} is missing")
    return int(f.tensors[name].shape[1])


def _check_rope_dims(f: GGUFFile, config: dict[str, Any], arch: str) -> None:
    """Partial rotary is Phi-3's alone here: elsewhere rope.dimension_count must be head_dim."""
    dims = f.arch_get("rope.dimension_count")
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    if dims is not None and arch != "Phi3ForCausalLM" and int(dims) != int(head_dim):
        raise ValueError(f"{f.path.name}: rope.dimension_count {dims} != head_dim {head_dim} (partial "
                         f"rotary) is not supported for {f.architecture} files")


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
    """The embedding's rows (llama.cpp's Gemma 3 converter drops rows past the real vocabulary, so
    the token list can be longer), else the token count, else ``<arch>.vocab_size``."""
    embd = f.tensors.get("token_embd.weight")
    if embd is not None:
        return int(embd.shape[-1])  # ggml order: ne[1] = rows
    tokens = f.reader.fields.get("tokenizer.ggml.tokens")
    if tokens is not None:
        return len(tokens.data)  # one entry per string: no need to decode 50k strings
    if f.arch_get("vocab_size") is None:
        raise ValueError(f"{f.path.name}: no token_embd.weight, token list or vocab_size "
                         "to size the vocabulary")
    return int(f.arch_get("vocab_size"))


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
