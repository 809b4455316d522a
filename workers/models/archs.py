"""What each supported decoder architecture's ``config.json`` means: one ``ArchSpec`` per Hugging
Face architecture name (``ARCHITECTURES``), which ``ModelConfig.from_dict`` reads.

Every architecture is the Llama block with switches (``models/decoder.py``), so a spec states only
where an architecture departs from Llama: its defaults are Llama's reading. The keys named here are
transformers' config fields; the rules that use them are transformers' own.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class MoESpec:
    """How a mixture-of-experts config names its experts (read by ``config._moe_fields``)."""

    experts_keys: tuple[str, ...]  # the number of routed experts: the first key given
    intermediate_key: str  # each routed expert's intermediate size
    every_layer: bool = False  # else the layers ``decoder_sparse_step`` and ``mlp_only_layers`` pick
    norm_topk_prob: bool | None = None  # fixed; None = the config's ``norm_topk_prob`` (default off)
    shared_expert: bool = False  # ``shared_expert_intermediate_size`` required (Qwen2-MoE)


@dataclass(frozen=True)
class ArchSpec:
    """How one architecture's config maps onto ``ModelConfig``; the defaults are Llama's."""

    model_type: str  # config.json's "model_type": names the family when "architectures" is absent
    # Attention biases: the key each is read from; None = fixed at its default whatever the config says.
    qkv_bias_key: str | None = "attention_bias"
    qkv_bias_default: bool = False
    o_bias_key: str | None = "attention_bias"
    qk_norm: bool = False
    phi3_rope: bool = False  # Phi3Config's LongRoPE: "su" / "yarn" mean longrope, its own original context
    # Sliding windows (a config's own ``layer_types`` always wins). By default every layer slides
    # when ``sliding_window`` is set.
    window_switch_key: str | None = None  # the window is off unless this key is true
    first_window_layer_key: str | None = None  # layers slide from this one on
    global_every: int = 0  # every n-th layer global, the others slide (0: by the window alone)
    global_every_key: str | None = None  # a config key that overrides ``global_every``
    # The block.
    activation: str = "silu"  # the one gate activation served
    activation_key: str = "hidden_act"  # Gemma's own name; ``hidden_act`` is then its fallback
    norm_unit_offset: bool = False
    sandwich_norms: bool = False
    scale_embeddings: bool = False
    tie_embeddings: bool = False  # ``tie_word_embeddings``'s default
    query_pre_attn_scalar: float | None = None  # the key's default; None = not read (head_dim ** -0.5)
    softcaps: tuple[tuple[str, float | None], ...] = ()  # soft-cap fields read, with their defaults
    local_rope: bool = False  # sliding layers have a RoPE of their own
    refuse_bidirectional: bool = False  # ``use_bidirectional_attention`` set: refused
    moe: MoESpec | None = None


_LLAMA = ArchSpec("llama")
# Qwen configs carry a window size even when it is off; it slides from max_window_layers on.
_QWEN2 = ArchSpec("qwen2", qkv_bias_key=None, qkv_bias_default=True, o_bias_key=None,
                  window_switch_key="use_sliding_window", first_window_layer_key="max_window_layers")
_QWEN3 = replace(_QWEN2, model_type="qwen3", qkv_bias_key="attention_bias", qkv_bias_default=False,
                 o_bias_key="attention_bias", qk_norm=True)
_QWEN_MOE = MoESpec(("num_experts", "num_local_experts"),  # transformers 5 writes Qwen3-MoE's second
                    "moe_intermediate_size")
# Gemma 2: GeGLU, (1 + w) RMSNorm in float32, four norms per layer, sqrt(hidden)-scaled embeddings,
# tied head; sliding and global layers alternate (layer 0 slides).
_GEMMA2 = ArchSpec("gemma2", activation="gelu_pytorch_tanh", activation_key="hidden_activation",
                   norm_unit_offset=True, sandwich_norms=True, scale_embeddings=True, tie_embeddings=True,
                   query_pre_attn_scalar=256.0, global_every=2, refuse_bidirectional=True,
                   softcaps=(("attn_logit_softcapping", 50.0), ("final_logit_softcapping", 30.0)))

#: The supported decoders by Hugging Face architecture name (the order is the error messages').
ARCHITECTURES: dict[str, ArchSpec] = {
    "LlamaForCausalLM": _LLAMA,
    "MistralForCausalLM": replace(_LLAMA, model_type="mistral"),
    "Qwen2ForCausalLM": _QWEN2,
    "Qwen3ForCausalLM": _QWEN3,
    "Phi3ForCausalLM": replace(_LLAMA, model_type="phi3", phi3_rope=True),
    # Mixtral routes in every layer and always renormalises the top-k weights.
    "MixtralForCausalLM": replace(_LLAMA, model_type="mixtral", moe=MoESpec(
        ("num_local_experts",), "intermediate_size", every_layer=True, norm_topk_prob=True)),
    "Qwen2MoeForCausalLM": replace(_QWEN2, model_type="qwen2_moe", qkv_bias_key="qkv_bias",
                                   moe=replace(_QWEN_MOE, shared_expert=True)),
    "Qwen3MoeForCausalLM": replace(_QWEN3, model_type="qwen3_moe", moe=_QWEN_MOE),
    "Gemma2ForCausalLM": _GEMMA2,
    # Gemma 3: q/k norms; every 6th layer global; sliding layers' own RoPE; no attention soft-cap
    # (transformers never passes the field to attention) and no final one by default.
    "Gemma3ForCausalLM": replace(_GEMMA2, model_type="gemma3_text", qk_norm=True, global_every=6,
                                 global_every_key="sliding_window_pattern", local_rope=True,
                                 softcaps=(("final_logit_softcapping", None),)),
}
