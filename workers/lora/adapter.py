"""PEFT LoRA adapters: a folder with ``adapter_config.json`` and ``adapter_model.safetensors``,
read, checked against the base model and laid out for our fused projections.

Our decoder fuses q/k/v into ``qkv_proj`` and gate/up into ``gate_up_proj`` (see
``models/decoder.py``); an adapter's ``q_proj`` pair fills the q slice of ``qkv_proj``'s group, a
``qkv_proj`` pair (Phi-3, whose checkpoint is fused) every slice of it (the same A, B split by rows).
The adapter's scaling (``lora_alpha / r``, or ``lora_alpha / sqrt(r)`` with ``use_rslora``) is
folded into its B matrices, which are converted to the engine's dtype.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from batchinfer.workers.models.config import ModelConfig

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
    weights: dict[tuple[int, str], tuple[torch.Tensor, tuple[torch.Tensor, ...]]] = field(
        default_factory=dict)
    base_model: str | None = None  # adapter_config.json's base_model_name_or_path (informational)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + sum(b.nbytes for b in bs) for a, bs in self.weights.values())


def load_adapter(name: str, path: str | Path, config: ModelConfig, *, max_rank: int,
                 dtype: torch.dtype) -> LoRAAdapter:
    """Read and check the PEFT adapter in ``path`` for a base model of ``config``.

    ``ValueError("lora adapter 'NAME' (PATH): ...")`` for anything it cannot serve, naming what
    is wrong: a missing file, a rank above ``max_rank``, a target outside ``GROUP_SLICES`` (or on a
    MoE layer's MLP), ``modules_to_save``, DoRA, biases, a tensor whose shape does not fit
    ``config`` (an adapter for another base model).
    """
    raise NotImplementedError  # filled in by the adapter loader's author
