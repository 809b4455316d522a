"""``ModelConfig``: the decoder's hyper-parameters, read from a Hugging Face ``config.json``.

Both config dialects are read: transformers 4.x (``rope_theta`` + ``rope_scaling``,
``torch_dtype``) and 5.x (``rope_parameters``, ``dtype``). ``auto_map`` and any other remote-code
hook are ignored: batchinfer never imports or runs code shipped with a checkpoint.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from batchinfer.workers.models.archs import ARCHITECTURES, ArchSpec, MoESpec

SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES)
# config.json files without "architectures" still name their family in "model_type".
_MODEL_TYPES = {spec.model_type: arch for arch, spec in ARCHITECTURES.items()}
#: Decoder checkpoints without an LM head (transformers' base classes, e.g. Qwen3-Embedding's
#: ``Qwen3Model``) -> the decoder that runs them; only the embedding engine loads these.
BASE_DECODERS = {
    "LlamaModel": "LlamaForCausalLM",
    "MistralModel": "MistralForCausalLM",
    "Qwen2Model": "Qwen2ForCausalLM",
    "Qwen3Model": "Qwen3ForCausalLM",
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")
_ROPE_REQUIRED = {  # fields the config itself must give (the others have transformers' defaults)
    "linear": ("factor",),
    "dynamic": ("factor",),
    "yarn": (),  # factor: else max_position_embeddings / original_max_position_embeddings
    "longrope": ("short_factor", "long_factor"),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor"),
}
# Layer types a transformers 5 ``rope_parameters`` may be nested under (one RoPE per kind of layer).
_ROPE_LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclass(frozen=True)
class ModelConfig:
    """What the decoder needs to know about a checkpoint; see ``from_dict`` for the mapping."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # None = plain RoPE; else has "rope_type"
    partial_rotary_factor: float = 1.0  # share of head_dim that RoPE rotates (Phi-4-mini: 0.75)
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()  # per layer: "full_attention" | "sliding_attention"
    qkv_bias: bool = False  # bias on q/k/v projections (Qwen2; Llama's attention_bias)
    o_bias: bool = False  # bias on the output projection (Llama/Qwen3 attention_bias)
    mlp_bias: bool = False
    qk_norm: bool = False  # per-head RMSNorm of q and k before RoPE (Qwen3, Gemma 3)
    # Gemma 2 / 3 (``ArchSpec``); the defaults are every other architecture's behaviour.
    hidden_act: str = "silu"  # gate activation: "silu" (SwiGLU) or "gelu_pytorch_tanh" (GeGLU)
    norm_unit_offset: bool = False  # RMSNorm scales by (1 + weight), in float32 before the cast
    sandwich_norms: bool = False  # norms after attention and before/after the MLP (4 per layer)
    scale_embeddings: bool = False  # embeddings times sqrt(hidden_size), rounded to the model dtype
    query_pre_attn_scalar: float | None = None  # attention scale = this ** -0.5 (None: head_dim ** -0.5)
    attn_logit_softcapping: float | None = None  # attention scores -> cap * tanh(scores / cap)
    final_logit_softcapping: float | None = None  # logits -> cap * tanh(logits / cap)
    rope_local_theta: float | None = None  # RoPE of sliding layers (Gemma 3); None = the global one
    rope_local_scaling: dict[str, Any] | None = None
    torch_dtype: str | None = None
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    # Mixture of experts (workers/models/moe.py); num_experts 0 = a dense MLP in every layer.
    num_experts: int = 0
    num_experts_per_tok: int = 0  # top-k
    moe_intermediate_size: int = 0  # each routed expert's intermediate size
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's sigmoid-gated shared expert; 0 = none
    norm_topk_prob: bool = True  # renormalise the top-k routing weights to sum to 1
    moe_layers: tuple[int, ...] = ()  # layers whose MLP is the sparse block (the others are dense)

    @property
    def rotary_dim(self) -> int:
        """The rotated channels of a head (the first ``rotary_dim``; transformers' ``int(head_dim * f)``)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def attention_bias(self) -> bool:
        """Whether the q/k/v projections carry a bias (the Hugging Face name)."""
        return self.qkv_bias

    def layer_sliding_window(self, layer: int) -> int | None:
        """The sliding window of one layer (None = full causal attention)."""
        if self.sliding_window is None:
            return None
        return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        """Read ``config.json`` (required) and ``generation_config.json`` (optional) of a model dir.

        A ``.gguf`` file (or a folder holding one and no safetensors): its metadata instead.
        """
        from batchinfer.workers.models.gguf.reader import GGUFFile, gguf_path

        model_dir = Path(model_dir)
        found = gguf_path(model_dir)
        if found is not None:
            from batchinfer.workers.models.gguf.hf_config import hf_config

            return cls.from_dict(*hf_config(GGUFFile(found)), source=str(found))
        path = model_dir / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path}: config.json not found in model directory {model_dir}")
        config = _read_json(path)
        gen_path = model_dir / "generation_config.json"
        generation = _read_json(gen_path) if gen_path.is_file() else None
        return cls.from_dict(config, generation, source=str(path))

    @classmethod
    def from_dict(
        cls, config: dict[str, Any], generation_config: dict[str, Any] | None = None, source: str = "config"
    ) -> ModelConfig:
        """Build from parsed ``config.json`` (and ``generation_config.json``) dictionaries.

        What differs between architectures comes from their ``ArchSpec`` (``models/archs.py``).
        """
        arch = _architecture(config, source)
        spec = ARCHITECTURES[arch]
        shape = _shape_fields(config, source)
        layers = shape["num_hidden_layers"]
        return cls(  # arguments are evaluated in order: this is the order of the refusals
            architecture=arch,
            **shape,
            **_block_fields(config, spec, arch, source),
            **_attention_fields(config, spec, layers, shape["head_dim"], source),
            vocab_size=_need(config, "vocab_size", source),
            intermediate_size=_need(config, "intermediate_size", source),
            **_moe_fields(config, spec.moe, arch, layers, source),
            torch_dtype=config.get("torch_dtype") or config.get("dtype"),
            bos_token_id=config.get("bos_token_id"),
            eos_token_ids=_merge_ids((generation_config or {}).get("eos_token_id"),
                                     config.get("eos_token_id")),
        )


def _need(config: dict[str, Any], key: str, source: str) -> int:
    if config.get(key) is None:
        raise ValueError(f"{source}: required field {key!r} is missing")
    return int(config[key])


def _shape_fields(config: dict[str, Any], source: str) -> dict[str, Any]:
    """The layers' shapes (and norm epsilon): hidden size, heads and layers are required."""
    hidden, heads = _need(config, "hidden_size", source), _need(config, "num_attention_heads", source)
    return {
        "hidden_size": hidden,
        "num_hidden_layers": _need(config, "num_hidden_layers", source),
        "num_attention_heads": heads,
        "num_key_value_heads": int(config.get("num_key_value_heads") or heads),
        "head_dim": int(config.get("head_dim") or hidden // heads),
        "max_position_embeddings": int(config.get("max_position_embeddings", 2048)),
        "rms_norm_eps": float(config.get("rms_norm_eps", 1e-6)),
    }


def _attention_fields(
    config: dict[str, Any], spec: ArchSpec, layers: int, head_dim: int, source: str,
) -> dict[str, Any]:
    """RoPE, sliding windows, biases and q/k norms."""
    rope_theta, rope_scaling = _rope(config, source, phi3=spec.phi3_rope)
    partial_rotary = _partial_rotary_factor(config, source, head_dim)
    sliding_window, layer_types = _sliding_layers(config, spec, layers, source)
    return {
        "rope_theta": rope_theta,
        "rope_scaling": rope_scaling,
        "partial_rotary_factor": partial_rotary,
        "sliding_window": sliding_window,
        "layer_types": layer_types,
        "qkv_bias": _flag(config, spec.qkv_bias_key, spec.qkv_bias_default),
        "o_bias": _flag(config, spec.o_bias_key, False),
        "mlp_bias": bool(config.get("mlp_bias", False)),
        "qk_norm": spec.qk_norm,
    }


def _flag(config: dict[str, Any], key: str | None, default: bool) -> bool:
    """``config[key]`` as a bool (``default`` when absent); no key: the architecture fixes it."""
    return default if key is None else bool(config.get(key, default))


def _sliding_layers(
    config: dict[str, Any], spec: ArchSpec, layers: int, source: str,
) -> tuple[int | None, tuple[str, ...]]:
    """The sliding window and each layer's attention type, by transformers' rules."""
    window = config.get("sliding_window")
    if spec.window_switch_key is not None and not config.get(spec.window_switch_key, False):
        window = None
    layer_types = config.get("layer_types")
    if layer_types is None and spec.global_every:
        every = spec.global_every
        if spec.global_every_key is not None:
            every = int(config.get(spec.global_every_key, every))
        layer_types = ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(layers)]
    if layer_types is None:
        first = 0
        if spec.first_window_layer_key is not None:
            first = int(config.get(spec.first_window_layer_key, layers))
        layer_types = ["sliding_attention" if window is not None and i >= first else "full_attention"
                       for i in range(layers)]
    if len(layer_types) != layers:
        raise ValueError(f"{source}: layer_types has {len(layer_types)} entries for {layers} layers")
    return (int(window) if window is not None else None), tuple(layer_types)


def _block_fields(config: dict[str, Any], spec: ArchSpec, arch: str, source: str) -> dict[str, Any]:
    """The activation, norms, embedding scale, tied head, soft-caps and local RoPE (Gemma's block)."""
    act = _activation(config, spec, arch, source)
    if spec.refuse_bidirectional and config.get("use_bidirectional_attention"):
        raise ValueError(f"{source}: use_bidirectional_attention is not supported (causal decoding only)")
    fields: dict[str, Any] = {
        "hidden_act": act,
        "norm_unit_offset": spec.norm_unit_offset,
        "sandwich_norms": spec.sandwich_norms,
        "scale_embeddings": spec.scale_embeddings,
        "tie_word_embeddings": bool(config.get("tie_word_embeddings", spec.tie_embeddings)),
    }
    if spec.query_pre_attn_scalar is not None:
        fields["query_pre_attn_scalar"] = float(config.get("query_pre_attn_scalar")
                                                or spec.query_pre_attn_scalar)
    for key, default in spec.softcaps:
        value = config.get(key, default)
        if value is not None and not float(value) > 0:
            raise ValueError(f"{source}: {key} must be > 0 or null, got {value!r}")
        fields[key] = None if value is None else float(value)
    if spec.local_rope:
        fields["rope_local_theta"], fields["rope_local_scaling"] = _local_rope(config, source)
    return fields


def _activation(config: dict[str, Any], spec: ArchSpec, arch: str, source: str) -> str:
    """The gate activation, refused unless it is the architecture's one."""
    if spec.activation_key == "hidden_act":
        act, where = config.get("hidden_act", spec.activation), ""
    else:  # Gemma's own key, with the generic one as its fallback
        act = config.get(spec.activation_key) or config.get("hidden_act") or spec.activation
        where = f" for {arch}"
    if act != spec.activation:
        raise ValueError(f"{source}: {spec.activation_key} {act!r} is not supported{where} "
                         f"(only {spec.activation!r})")
    return str(act)


def _local_rope(config: dict[str, Any], source: str) -> tuple[float, dict[str, Any] | None]:
    """The RoPE of Gemma 3's sliding layers: transformers 5 nests ``rope_parameters`` by layer
    type; 4.x gives ``rope_local_base_freq`` (never scaled)."""
    params = config.get("rope_parameters")
    nested = isinstance(params, dict) and isinstance(params.get("sliding_attention"), dict)
    local = config if nested else {**config, "rope_parameters": None, "rope_scaling": None,
                                   "rope_theta": config.get("rope_local_base_freq", 10000.0)}
    return _rope(local, source, "sliding_attention")


def _moe_fields(
    config: dict[str, Any], moe: MoESpec | None, arch: str, layers: int, source: str,
) -> dict[str, Any]:
    """The MoE fields of ``ModelConfig`` (empty for dense architectures), with transformers' rules:
    MoE layers are every layer, or those with ``(i + 1) % decoder_sparse_step == 0`` not in
    ``mlp_only_layers``."""
    if moe is None:
        return {}
    experts_key = next((k for k in moe.experts_keys if config.get(k) is not None), moe.experts_keys[0])
    keys = [experts_key, "num_experts_per_tok", moe.intermediate_key]
    missing = [k for k in keys if config.get(k) is None]
    if moe.shared_expert and config.get("shared_expert_intermediate_size") is None:
        missing.append("shared_expert_intermediate_size")
    if missing:
        raise ValueError(f"{source}: required field {missing[0]!r} is missing ({arch})")
    experts, top_k, inter = (int(config[k]) for k in keys)
    if not 1 <= top_k <= experts:
        raise ValueError(f"{source}: num_experts_per_tok {top_k} must be in 1..{experts} "
                         "(the number of experts)")
    step = 1 if moe.every_layer else int(config.get("decoder_sparse_step") or 1)
    dense = set() if moe.every_layer else {int(i) for i in config.get("mlp_only_layers") or []}
    norm = moe.norm_topk_prob
    return {
        "num_experts": experts,
        "num_experts_per_tok": top_k,
        "moe_intermediate_size": inter,
        "shared_expert_intermediate_size": int(config.get("shared_expert_intermediate_size") or 0),
        "norm_topk_prob": bool(config.get("norm_topk_prob", False)) if norm is None else norm,
        "moe_layers": tuple(i for i in range(layers) if (i + 1) % step == 0 and i not in dense),
    }


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: invalid JSON at line {e.lineno}: {e.msg}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return data


def _architecture(config: dict[str, Any], source: str) -> str:
    names = config.get("architectures") or []
    if not names and config.get("model_type") in _MODEL_TYPES:
        names = [_MODEL_TYPES[config["model_type"]]]
    for name in names:
        name = BASE_DECODERS.get(name, name)
        if name in SUPPORTED_ARCHITECTURES:
            return name
    found = ", ".join(map(str, names)) or f"model_type {config.get('model_type')!r}"
    raise ValueError(
        f"{source}: unsupported architecture {found}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
    )


def _rope(
    config: dict[str, Any], source: str, layer_type: str = "full_attention", phi3: bool = False,
) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, scaling) from ``rope_parameters`` (5.x) or ``rope_scaling`` + ``rope_theta`` (4.x).

    The scaling dict is what ``rope.cos_sin_cache`` reads: ``rope_type`` and that type's fields,
    with ``original_max_position_embeddings`` (and ``factor`` where transformers derives it)
    filled in as transformers does. A ``rope_parameters`` nested by layer type (Gemma 3 in 5.x)
    gives ``layer_type``'s entry. None = plain RoPE.
    ``phi3``: Phi3Config's reading (its LongRoPE names, its own original context length).
    """
    params = _rope_dict(config, layer_type, source)
    theta = float(params.pop("rope_theta", None) or config.get("rope_theta") or 10000.0)
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    params.pop("partial_rotary_factor", None)  # read by _partial_rotary_factor
    if phi3 and rope_type in ("su", "yarn"):
        rope_type = "longrope"  # transformers' Phi3Config renames Phi-3's first names for LongRoPE
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"{source}: rope scaling type {rope_type!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if rope_type == "default":
        return theta, None
    missing = [k for k in _ROPE_REQUIRED[rope_type] if params.get(k) is None]
    if missing:
        raise ValueError(f"{source}: rope scaling {rope_type!r} needs {', '.join(missing)}")
    max_positions = int(config.get("max_position_embeddings", 2048))
    if rope_type == "dynamic":
        # transformers scales dynamic NTK from the model's own context length.
        params["original_max_position_embeddings"] = max_positions
    elif rope_type in ("yarn", "longrope", "llama3"):
        original = params.get("original_max_position_embeddings")
        if phi3:
            # Phi3Config's own field (default 4096) wins over the one inside rope_scaling.
            original = config.get("original_max_position_embeddings") or 4096
        params["original_max_position_embeddings"] = int(original or max_positions)
        if rope_type != "llama3" and params.get("factor") is None:
            params["factor"] = max_positions / params["original_max_position_embeddings"]
    for key in ("short_factor", "long_factor"):
        if key in params and not (isinstance(params[key], list)
                                  and all(isinstance(x, (int, float)) for x in params[key])):
            raise ValueError(f"{source}: rope scaling {key} must be a list of numbers")
    return theta, {"rope_type": rope_type, **params}


def _rope_dict(config: dict[str, Any], layer_type: str, source: str) -> dict[str, Any]:
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise ValueError(f"{source}: rope_parameters / rope_scaling must be an object, got {params!r}")
    if any(isinstance(params.get(t), dict) for t in _ROPE_LAYER_TYPES):  # nested by layer type
        params = params.get(layer_type) or {}
    return dict(params)


def _partial_rotary_factor(config: dict[str, Any], source: str, head_dim: int) -> float:
    """The rope dict's ``partial_rotary_factor`` (5.x), else the config's own (4.x), else 1."""
    params = _rope_dict(config, "full_attention", source)
    factor = params.get("partial_rotary_factor")
    factor = float(config.get("partial_rotary_factor", 1.0) if factor is None else factor)
    rotary = int(head_dim * factor)
    if not 0.0 < factor <= 1.0 or rotary < 2 or rotary % 2:
        raise ValueError(f"{source}: partial_rotary_factor {factor} gives {rotary} rotary channels of "
                         f"head_dim {head_dim}; it must be in (0, 1] and give an even number")
    longrope = [k for k in ("short_factor", "long_factor") if isinstance(params.get(k), list)]
    for key in longrope:
        if len(params[key]) != rotary // 2:
            raise ValueError(f"{source}: rope scaling {key} has {len(params[key])} entries; "
                             f"{rotary // 2} expected (rotary dimension {rotary} / 2)")
    return factor


def _merge_ids(*values: Any) -> list[int]:
    """Union of token ids (ints or lists of ints), first-seen order."""
    out: list[int] = []
    for value in values:
        for v in value if isinstance(value, list) else [value]:
            if v is not None and int(v) not in out:
                out.append(int(v))
    return out
