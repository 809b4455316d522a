"""The stacked LoRA weights the forward reads: one A and one B per slice of every LoRA-capable
projection, for ``max_loras`` adapter slots side by side (``add_lora``'s layout).

A slot holds one adapter's weights, zero-padded to ``max_rank`` (the padding adds nothing);
``LoRAManager`` decides which adapter lives in which slot. ``LoRAStep`` is what one forward
gets: the step's ``LoRAMapping`` bound to the stack, called by the decoder after each projection.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from batchinfer.kernels.lora import LoRAMapping, add_lora
from batchinfer.workers.lora.adapter import LoRAAdapter, lora_groups
from batchinfer.workers.models.model_config import ModelConfig

# (layer, group name) -> (A [L, S * R, in], S x B [L, out_i, R])
StackedWeights = dict[tuple[int, str], tuple[torch.Tensor, tuple[torch.Tensor, ...]]]


class LoRAStack:
    """Zero-initialised weights of ``max_loras`` slots of rank ``max_rank`` for every layer's groups."""

    def __init__(self, config: ModelConfig, max_loras: int, max_rank: int, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.device = torch.device(device)
        R = max_rank
        self.weights: StackedWeights = {}
        for layer in range(config.num_hidden_layers):
            for g in lora_groups(config, layer):
                a = torch.zeros(max_loras, len(g.slices) * R, g.in_features, dtype=dtype, device=device)
                bs = tuple(torch.zeros(max_loras, out, R, dtype=dtype, device=device)
                           for out in g.out_features)
                self.weights[(layer, g.name)] = (a, bs)
        self.slot_ranks = [0] * max_loras  # LoRAMapping.build's slot_ranks (0: empty slot)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + sum(b.nbytes for b in bs) for a, bs in self.weights.values())

    @torch.inference_mode()  # in place on the stack, whether or not it was made in inference mode
    def load(self, slot: int, adapter: LoRAAdapter) -> None:
        """Copy ``adapter`` into ``slot`` (whatever it held before is cleared first)."""
        if adapter.rank > self.max_rank:
            raise ValueError(f"lora adapter {adapter.name!r}: rank {adapter.rank} exceeds max_lora_rank "
                             f"{self.max_rank}")
        self.clear(slot)
        R, r = self.max_rank, adapter.rank
        for key, (a, bs) in adapter.weights.items():
            if key not in self.weights:
                raise ValueError(f"lora adapter {adapter.name!r}: layer {key[0]} has no LoRA group "
                                 f"{key[1]!r}")
            stack_a, stack_bs = self.weights[key]
            for i, b in enumerate(bs):  # slice i: its rank rows of A, its rank columns of B
                stack_a[slot, i * R:i * R + r].copy_(a[i * r:(i + 1) * r])
                stack_bs[i][slot, :, :r].copy_(b)
        self.slot_ranks[slot] = r

    @torch.inference_mode()
    def clear(self, slot: int) -> None:
        for a, bs in self.weights.values():
            a[slot].zero_()
            for b in bs:
                b[slot].zero_()
        self.slot_ranks[slot] = 0

    def step(self, token_slots: np.ndarray) -> LoRAStep | None:
        """The adapters of a step whose token t uses slot ``token_slots[t]`` [T] (-1: none);
        None when no token uses one."""
        mapping = LoRAMapping.build(token_slots, self.slot_ranks, self.device)
        return None if mapping is None else LoRAStep(mapping, self)

    def apply(self, layer: int, group: str, y: torch.Tensor, x: torch.Tensor,
              mapping: LoRAMapping) -> torch.Tensor:
        """``y`` [T, sum(out_i)] += each token's adapter delta of ``x`` [T, in] (in place)."""
        a, bs = self.weights[(layer, group)]
        return add_lora(y, x, a, bs, mapping)


@dataclass(frozen=True)
class LoRAStep:
    """One forward's adapters: which token uses which slot of ``stack``."""

    mapping: LoRAMapping
    stack: LoRAStack

    def apply(self, layer: int, group: str, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.stack.apply(layer, group, y, x, self.mapping)
