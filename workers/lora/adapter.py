"""PEFT LoRA adapters: a folder with ``adapter_config.json`` and ``adapter_model.safetensors``,
read, checked against the base model and laid out for our fused projections.

Our decoder fuses q/k/v into ``qkv_proj`` and gate/up into ``gate_up_proj`` (see
``models/decoder.py``); an adapter's ``q_proj`` pair fills the q slice of ``qkv_proj``'s group, a
``qkv_proj`` pair (Phi-3, whose checkpoint is fused) every slice of it (the same A, B split by rows).
The adapter's scaling (``lora_alpha / r``, or ``lora_alpha / sqrt(r)`` with ``use_rslora``) is
folded into its B matrices, which are converted to the engine's dtype.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import torch
from safetensors import safe_open

from batchinfer.workers.models.model_config import ModelConfig

# The projections of a decoder layer an adapter may target, by our fused group.
GROUP_SLICES: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "o_proj": ("o_proj",),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "down_proj": ("down_proj",),
}


@dataclass(frozen=True)
class LoRAGroup:
    """One LoRA-capable projection of a decoder layer in our fused layout: ``in_features`` in,
    ``out_features[i]`` out for each of its ``slices`` (PEFT module names), side by side."""

    name: str
    in_features: int
    slices: tuple[str, ...]
    out_features: tuple[int, ...]


def lora_groups(config: ModelConfig, layer: int) -> tuple[LoRAGroup, ...]:
    """The groups of decoder layer ``layer`` (a MoE layer has no dense MLP: attention's only)."""
    c = config
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    groups = [LoRAGroup("qkv_proj", c.hidden_size, GROUP_SLICES["qkv_proj"], (q, kv, kv)),
              LoRAGroup("o_proj", q, GROUP_SLICES["o_proj"], (c.hidden_size,))]
    if layer not in c.moe_layers:
        inter = c.intermediate_size
        groups += [LoRAGroup("gate_up_proj", c.hidden_size, GROUP_SLICES["gate_up_proj"], (inter, inter)),
                   LoRAGroup("down_proj", inter, GROUP_SLICES["down_proj"], (c.hidden_size,))]
    return tuple(groups)


# (layer, group) -> (A, Bs): see ``LoRAAdapter``.
FusedWeights = dict[tuple[int, str], tuple[torch.Tensor, tuple[torch.Tensor, ...]]]


@dataclass
class LoRAAdapter:
    """A loaded adapter, ready to be copied into a slot of the stacked weights.

    ``weights[(layer, group)] = (A, Bs)``: A ``[len(slices) * rank, in]`` (slice i's rows
    ``[i*rank, (i+1)*rank)``), Bs one ``[out_i, rank]`` per slice, scaling folded in; the slices
    of a group the adapter does not target are zeros, groups it does not touch are absent.
    Tensors are on the CPU in the engine's dtype.
    """

    name: str
    path: str
    rank: int
    scaling: float
    weights: FusedWeights = field(default_factory=dict)
    base_model: str | None = None  # adapter_config.json's base_model_name_or_path (informational)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + sum(b.nbytes for b in bs) for a, bs in self.weights.values())


Fail = Callable[[str], NoReturn]  # raises the adapter's ValueError with this message
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# A PEFT module name (after ``layers.N.``) -> (our group, the slices of it the module fills).
# A fused module (Phi-3's qkv_proj / gate_up_proj) fills every slice: one A, B split by rows.
_TARGETS: dict[str, tuple[str, tuple[int, ...]]] = {
    "self_attn.q_proj": ("qkv_proj", (0,)),
    "self_attn.k_proj": ("qkv_proj", (1,)),
    "self_attn.v_proj": ("qkv_proj", (2,)),
    "self_attn.qkv_proj": ("qkv_proj", (0, 1, 2)),
    "self_attn.o_proj": ("o_proj", (0,)),
    "mlp.gate_proj": ("gate_up_proj", (0,)),
    "mlp.up_proj": ("gate_up_proj", (1,)),
    "mlp.gate_up_proj": ("gate_up_proj", (0, 1)),
    "mlp.down_proj": ("down_proj", (0,)),
}
SUPPORTED_TARGETS = tuple(t.split(".")[1] for t in _TARGETS)
# ``<module>.lora_A[.<adapter name>].weight``: PEFT drops the adapter name on save, older tools keep it.
_TENSOR_KEY = re.compile(r"(?P<module>.+)\.(?P<ab>lora_A|lora_B)(?:\.[^.]+)?\.weight")
_LAYER_MODULE = re.compile(r"(?:.*\.)?layers\.(?P<layer>\d+)\.(?P<sub>.+)")
_PEFT_PREFIX = "base_model.model."  # PeftModel -> LoraModel -> the CausalLM
# adapter_config.json fields that change what the adapter computes beyond W x + s * B A x:
# set (truthy), the adapter cannot be served.
_REFUSED_FIELDS = {
    "modules_to_save": "modules_to_save (fully trained copies of base modules)",
    "use_dora": "use_dora (DoRA's magnitude vectors)",
    "lora_bias": "lora_bias (a bias on B)",
    "fan_in_fan_out": "fan_in_fan_out (Conv1D-style transposed weights)",
    "trainable_token_indices": "trainable_token_indices (trained embedding rows)",
    "layer_replication": "layer_replication (a model with repeated layers)",
    "target_parameters": "target_parameters (LoRA on bare parameters, e.g. MoE experts)",
    "alora_invocation_tokens": "alora_invocation_tokens (activated LoRA)",
    "use_qalora": "use_qalora",
    "monteclora_config": "monteclora_config",
    "use_bdlora": "use_bdlora (block-diagonal LoRA)",
    "arrow_config": "arrow_config (routed adapters)",
    "kasa_config": "kasa_config (KaSA's singular values between A and B)",
}


def load_adapter(name: str, path: str | Path, config: ModelConfig, *, max_rank: int,
                 dtype: torch.dtype) -> LoRAAdapter:
    """Read and check the PEFT adapter in ``path`` for a base model of ``config``.

    ``ValueError("lora adapter 'NAME' (PATH): ...")`` for anything it cannot serve, naming what
    is wrong: a missing file, a rank above ``max_rank``, a target outside ``GROUP_SLICES`` (or on a
    MoE layer's MLP), ``modules_to_save``, DoRA, biases, a tensor whose shape does not fit
    ``config`` (an adapter for another base model).

    Each module's scaling comes from its own ``r`` and ``lora_alpha`` (``rank_pattern`` /
    ``alpha_pattern`` matched as PEFT does); the adapter's ``rank`` is the largest of them, smaller
    modules are zero-padded to it, and ``scaling`` is the adapter-wide ``lora_alpha / r`` (the
    folded B matrices carry each module's own).
    """
    where = f"lora adapter '{name}' ({path})"

    def fail(message: str) -> NoReturn:
        raise ValueError(f"{where}: {message}")

    folder = Path(path)
    peft_config = _read_config(folder, fail)
    tensors = _read_tensors(folder, fail)
    scaling = _Scaling.read(peft_config, fail)
    pairs = _pair_tensors(tensors, config, fail)
    groups = {(layer, g.name): g for layer in range(config.num_hidden_layers)
              for g in lora_groups(config, layer)}
    modules = {key: _checked_module(key, pairs[key], groups, scaling, fail) for key in sorted(pairs)}
    rank = max(m.r for m in modules.values())
    if rank > max_rank:
        fail(f"its rank {rank} is above the limit of {max_rank}; raise max_lora_rank "
             f"(--max-lora-rank) to at least {rank} to serve it")
    base_model = peft_config.get("base_model_name_or_path")
    return LoRAAdapter(name=name, path=str(path), rank=rank, scaling=scaling.scale(scaling.r, scaling.alpha),
                       weights=_fused_weights(modules, groups, rank, dtype, fail),
                       base_model=base_model if isinstance(base_model, str) else None)


@dataclass(frozen=True)
class _Scaling:
    """``adapter_config.json``'s ``r`` / ``lora_alpha``, their per-module patterns and ``use_rslora``."""

    r: int
    alpha: Any  # a positive number, as given
    rslora: bool
    rank_pattern: dict[str, Any]
    alpha_pattern: dict[str, Any]

    @classmethod
    def read(cls, peft_config: dict[str, Any], fail: Fail) -> _Scaling:
        return cls(r=_positive(peft_config, "r", fail, integer=True),
                   alpha=_positive(peft_config, "lora_alpha", fail),
                   rslora=bool(peft_config.get("use_rslora", False)),
                   rank_pattern=_pattern(peft_config, "rank_pattern", fail, integer=True),
                   alpha_pattern=_pattern(peft_config, "alpha_pattern", fail))

    def of(self, module: str) -> tuple[int, float]:
        """(r, lora_alpha) of one module (its name in the model), patterns matched as PEFT does."""
        r: int = self.rank_pattern.get(_pattern_key(self.rank_pattern, module), self.r)
        return r, float(self.alpha_pattern.get(_pattern_key(self.alpha_pattern, module), self.alpha))

    def scale(self, r: int, alpha: Any) -> float:
        """``lora_alpha / r``, or ``lora_alpha / sqrt(r)`` with ``use_rslora``."""
        return float(alpha / math.sqrt(r) if self.rslora else alpha / r)


@dataclass
class _Pair:
    """One targeted module's tensors: ``ab["lora_A"] = (key, tensor)``; ``module``: its name in the model."""

    module: str
    ab: dict[str, tuple[str, torch.Tensor]] = field(default_factory=dict)


@dataclass(frozen=True)
class _Module:
    """One module's checked A ``[r, in]`` and B ``[out, r]``, its ``r`` and scaling."""

    a: torch.Tensor
    b: torch.Tensor
    r: int
    scaling: float


def _pair_tensors(tensors: dict[str, torch.Tensor], config: ModelConfig, fail: Fail
                  ) -> dict[tuple[int, str], _Pair]:
    """The LoRA tensors by (layer, PEFT module), every target one we serve; anything else refused."""
    for key in tensors:
        if "lora_embedding" in key:
            fail(f"tensor {key!r} is a LoRA on an embedding layer, which cannot be served; supported "
                 f"targets: {', '.join(SUPPORTED_TARGETS)}")
    pairs: dict[tuple[int, str], _Pair] = {}
    for key, tensor in tensors.items():  # pairs first: a refused target is named before its base weight
        match = _TENSOR_KEY.fullmatch(key)
        if match is None:
            continue
        module = match["module"].removeprefix(_PEFT_PREFIX)
        pair = pairs.setdefault(_target(key, module, config, fail), _Pair(module))
        if match["ab"] in pair.ab:
            fail(f"tensors {pair.ab[match['ab']][0]!r} and {key!r} are both {match['ab']} of one module")
        pair.ab[match["ab"]] = (key, tensor)
        pair.module = module
    for key in tensors:
        if _TENSOR_KEY.fullmatch(key) is None:
            fail(f"tensor {key!r} is not a LoRA A/B weight (a full weight, as modules_to_save or "
                 "save_embedding_layers save, or a LoRA variant's extra tensor); only lora_A / lora_B "
                 f"weights of {', '.join(SUPPORTED_TARGETS)} can be served")
    if not pairs:
        fail(f"{ADAPTER_WEIGHTS} holds no LoRA tensors")
    return pairs


def _target(key: str, module: str, config: ModelConfig, fail: Fail) -> tuple[int, str]:
    """(layer, PEFT module after ``layers.N.``) of tensor ``key``, checked against the base model."""
    in_layer = _LAYER_MODULE.fullmatch(module)
    if in_layer is None:
        fail(f"tensor {key!r} targets {module!r}, which cannot be served; supported targets: "
             f"{', '.join(SUPPORTED_TARGETS)} of the decoder layers")
    layer, sub = int(in_layer["layer"]), in_layer["sub"]
    if layer >= config.num_hidden_layers:
        fail(f"tensor {key!r} is for layer {layer}, but the base model has "
             f"{config.num_hidden_layers} layers: is this adapter for another base model?")
    if layer in config.moe_layers and not sub.startswith("self_attn."):
        fail(f"tensor {key!r} targets {sub!r} of layer {layer}, a mixture-of-experts layer: "
             "only its attention projections (q_proj, k_proj, v_proj, o_proj) can take a LoRA")
    if sub not in _TARGETS:
        fail(f"tensor {key!r} targets {sub!r}, which cannot be served; supported targets: "
             f"{', '.join(SUPPORTED_TARGETS)}")
    return layer, sub


def _checked_module(where: tuple[int, str], pair: _Pair, groups: dict[tuple[int, str], LoRAGroup],
                    scaling: _Scaling, fail: Fail) -> _Module:
    """One module's A and B, with both present and shaped for its ``r`` and the base model."""
    layer, sub = where
    for ab in ("lora_A", "lora_B"):
        if ab not in pair.ab:
            other = pair.ab["lora_B" if ab == "lora_A" else "lora_A"][0]
            fail(f"tensor {other!r} has no {ab} partner ({ab} of layers.{layer}.{sub} is missing)")
    (a_key, a), (b_key, b) = pair.ab["lora_A"], pair.ab["lora_B"]
    r, alpha = scaling.of(pair.module)
    group_name, slices = _TARGETS[sub]
    group = groups[(layer, group_name)]
    outs = sum(group.out_features[i] for i in slices)
    for key, tensor, need, rank_dim in ((a_key, a, (r, group.in_features), 0), (b_key, b, (outs, r), 1)):
        if tuple(tensor.shape) == need:
            continue
        fixed = 1 - rank_dim  # the dimension the base model sets
        if tensor.dim() == 2 and tensor.shape[fixed] == need[fixed]:
            fail(f"tensor {key!r} has rank {tensor.shape[rank_dim]}, but {ADAPTER_CONFIG} gives "
                 f"r={r} for {pair.module!r}")
        fail(f"tensor {key!r} has shape {tuple(tensor.shape)}, the base model needs {need}: "
             "is this adapter for another base model?")
    return _Module(a, b, r, scaling.scale(r, alpha))


def _fused_weights(modules: dict[tuple[int, str], _Module], groups: dict[tuple[int, str], LoRAGroup],
                   rank: int, dtype: torch.dtype, fail: Fail) -> FusedWeights:
    """Each module's A and scaled B in its slices of its group (``LoRAAdapter.weights``), padded to
    ``rank`` with zeros."""
    weights: FusedWeights = {}
    filled: dict[tuple[int, str, int], str] = {}  # (layer, group, slice) -> the module that filled it
    for (layer, sub), m in modules.items():
        group_name, slices = _TARGETS[sub]
        group = groups[(layer, group_name)]
        if (layer, group_name) not in weights:
            weights[(layer, group_name)] = (
                torch.zeros(len(group.slices) * rank, group.in_features, dtype=dtype),  # [S*R, in]
                tuple(torch.zeros(out, rank, dtype=dtype) for out in group.out_features))  # S x [out_i, R]
        big_a, bs = weights[(layer, group_name)]
        b_scaled = m.b.float() * m.scaling  # [sum(out of slices), r], folded in float32
        row = 0
        for i in slices:
            if (layer, group_name, i) in filled:
                fail(f"layers.{layer}.{filled[(layer, group_name, i)]} and layers.{layer}.{sub} both "
                     f"target the {group.slices[i]} part of layer {layer}'s {group_name}")
            filled[(layer, group_name, i)] = sub
            out = group.out_features[i]
            big_a[i * rank:i * rank + m.r] = m.a.to(dtype)
            bs[i][:, :m.r] = b_scaled[row:row + out].to(dtype)
            row += out
    return weights


def _pattern_key(pattern: dict[str, Any], module: str) -> str:
    """PEFT's ``get_pattern_key`` (peft 0.21): the first pattern that matches the end of the
    module's name at a ``.`` boundary, as a regular expression; else the module's name itself."""
    for key in pattern:
        if re.match(rf"(.*\.)?({key})$", module):
            return key
    return module


def _read_config(folder: Path, fail: Fail) -> dict[str, Any]:
    if not folder.is_dir():
        fail("not a folder (a PEFT adapter is a folder with adapter_config.json and "
             f"{ADAPTER_WEIGHTS})")
    config_path = folder / ADAPTER_CONFIG
    if not config_path.is_file():
        fail(f"no {ADAPTER_CONFIG} (is this a PEFT adapter folder?)")
    try:
        peft_config = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        fail(f"{ADAPTER_CONFIG} cannot be read: {e}")
    if not isinstance(peft_config, dict):
        fail(f"{ADAPTER_CONFIG} is not a JSON object")
    if peft_config.get("peft_type") != "LORA":
        fail(f"peft_type is {peft_config.get('peft_type')!r}; only 'LORA' adapters can be served")
    for field_name, what in _REFUSED_FIELDS.items():
        if peft_config.get(field_name):
            fail(f"{what} is set ({field_name}={peft_config[field_name]!r}); only plain LoRA "
                 "adapters can be served")
    if peft_config.get("bias", "none") != "none":
        fail(f"bias={peft_config['bias']!r} trains base-model biases; only bias='none' can be served")
    return peft_config


def _read_tensors(folder: Path, fail: Fail) -> dict[str, torch.Tensor]:
    weights = folder / ADAPTER_WEIGHTS
    if not weights.is_file():
        if (folder / "adapter_model.bin").is_file():
            fail(f"only {ADAPTER_WEIGHTS} is read, and this folder has adapter_model.bin (a pickle, "
                 "never loaded); convert it: re-save it with PEFT's save_pretrained(safe_serialization=True)")
        fail(f"no {ADAPTER_WEIGHTS}")
    try:
        with safe_open(str(weights), framework="pt", device="cpu") as f:
            return {key: f.get_tensor(key) for key in f.keys()}  # noqa: SIM118 (safe_open is not a dict)
    except Exception as e:  # safetensors raises its own error types for a damaged file
        fail(f"{ADAPTER_WEIGHTS} cannot be read: {e}")


def _positive(peft_config: dict[str, Any], key: str, fail: Fail,
              integer: bool = False) -> Any:
    value: Any = peft_config.get(key)
    if not _is_positive(value, integer):
        fail(f"{ADAPTER_CONFIG}: {key} must be a positive {'integer' if integer else 'number'}, "
             f"got {value!r}")
    return int(value) if integer else value


def _is_positive(value: Any, integer: bool) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        return False
    return not integer or float(value).is_integer()


def _pattern(peft_config: dict[str, Any], key: str, fail: Fail,
             integer: bool = False) -> dict[str, Any]:
    """``rank_pattern`` / ``alpha_pattern``: regular expressions -> positive values (ranks: integers)."""
    value = peft_config.get(key) or {}
    if not isinstance(value, dict) or not all(_is_positive(v, integer) for v in value.values()):
        fail(f"{ADAPTER_CONFIG}: {key} must map module names to positive "
             f"{'integers' if integer else 'numbers'}, got {value!r}")
    for pattern in value:
        try:
            re.compile(pattern)
        except re.error as e:
            fail(f"{ADAPTER_CONFIG}: {key} key {pattern!r} is not a regular expression ({e})")
    return {k: int(v) if integer else v for k, v in value.items()}
