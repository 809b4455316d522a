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

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)
# config.json files without "architectures" still name their family in "model_type".
_MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
_ROPE_REQUIRED = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}


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
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()  # per layer: "full_attention" | "sliding_attention"
    qkv_bias: bool = False  # bias on q/k/v projections (Qwen2; Llama's attention_bias)
    o_bias: bool = False  # bias on the output projection (Llama/Qwen3 attention_bias)
    mlp_bias: bool = False
    qk_norm: bool = False  # per-head RMSNorm of q and k before RoPE (Qwen3)
    torch_dtype: str | None = None
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)

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
        """Read ``config.json`` (required) and ``generation_config.json`` (optional) of a model dir."""
        model_dir = Path(model_dir)
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
        """Build from parsed ``config.json`` (and ``generation_config.json``) dictionaries."""
        arch = _architecture(config, source)
        is_qwen = arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM")

        def need(key: str) -> Any:
            if config.get(key) is None:
                raise ValueError(f"{source}: required field {key!r} is missing")
            return config[key]

        hidden = int(need("hidden_size"))
        heads = int(need("num_attention_heads"))
        layers = int(need("num_hidden_layers"))
        if config.get("hidden_act", "silu") != "silu":
            raise ValueError(f"{source}: hidden_act {config['hidden_act']!r} is not supported (only 'silu')")
        head_dim = config.get("head_dim") or hidden // heads
        rope_theta, rope_scaling = _rope(config, source)

        sliding_window = config.get("sliding_window")
        if is_qwen and not config.get("use_sliding_window", False):
            sliding_window = None  # Qwen configs carry a window size even when it is off
        layer_types = config.get("layer_types")
        if layer_types is None:
            # Mistral: every layer slides; Qwen: layers from max_window_layers on (transformers' rule).
            first = int(config.get("max_window_layers", layers)) if is_qwen else 0
            sliding = sliding_window is not None
            layer_types = ["sliding_attention" if sliding and i >= first else "full_attention"
                           for i in range(layers)]
        if len(layer_types) != layers:
            raise ValueError(f"{source}: layer_types has {len(layer_types)} entries for {layers} layers")

        attention_bias = bool(config.get("attention_bias", False))
        qkv_bias = True if arch == "Qwen2ForCausalLM" else attention_bias
        o_bias = False if arch == "Qwen2ForCausalLM" else attention_bias

        return cls(
            architecture=arch,
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            sliding_window=int(sliding_window) if sliding_window is not None else None,
            layer_types=tuple(layer_types),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=bool(config.get("mlp_bias", False)),
            qk_norm=arch == "Qwen3ForCausalLM",
            torch_dtype=config.get("torch_dtype") or config.get("dtype"),
            bos_token_id=config.get("bos_token_id"),
            eos_token_ids=_merge_ids((generation_config or {}).get("eos_token_id"),
                                     config.get("eos_token_id")),
        )


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
        if name in SUPPORTED_ARCHITECTURES:
            return name
    found = ", ".join(map(str, names)) or f"model_type {config.get('model_type')!r}"
    raise ValueError(
        f"{source}: unsupported architecture {found}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
    )


def _rope(config: dict[str, Any], source: str) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, scaling) from either ``rope_parameters`` (5.x) or ``rope_scaling`` (4.x)."""
    params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    theta = float(params.pop("rope_theta", None) or config.get("rope_theta") or 10000.0)
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    if float(params.pop("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))) != 1.0:
        raise ValueError(f"{source}: partial_rotary_factor != 1 is not supported")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"{source}: rope scaling type {rope_type!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if rope_type == "default":
        return theta, None
    missing = [k for k in _ROPE_REQUIRED[rope_type] if params.get(k) is None]
    if rope_type == "llama3" and missing == ["original_max_position_embeddings"]:
        params["original_max_position_embeddings"] = config.get("max_position_embeddings")
        missing = []
    if missing:
        raise ValueError(f"{source}: rope scaling {rope_type!r} needs {', '.join(missing)}")
    return theta, {"rope_type": rope_type, **params}


def _merge_ids(*values: Any) -> list[int]:
    """Union of token ids (ints or lists of ints), first-seen order."""
    out: list[int] = []
    for value in values:
        for v in value if isinstance(value, list) else [value]:
            if v is not None and int(v) not in out:
                out.append(int(v))
    return out
