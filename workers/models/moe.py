"""The sparse mixture-of-experts feed-forward (Mixtral, Qwen2-MoE, Qwen3-MoE) and its checkpoint names.

``SparseMoeBlock`` holds the router (``gate``, ``[E, C]``), every expert's gate and up rows stacked
as ``w13 [E, 2I, C]`` and the down projections as ``w2 [E, C, I]``, and for Qwen2-MoE a shared
expert whose output is scaled by ``sigmoid(shared_expert_gate(x))`` and added. The computation is
``kernels.moe.fused_moe`` (backend chosen for the device).

Checkpoints store one tensor per expert; ``checkpoint_target`` maps those names (Mixtral's
``block_sparse_moe.experts.N.w1/w3/w2``, Qwen's ``mlp.experts.N.gate_proj/up_proj/down_proj``) to a
slice of the stacked parameters, which the loader fills in place.

Under tensor parallelism (``tp``) the block is built from the rank's local config: every expert's
intermediate (and the shared expert's) is this rank's share, so the routed and shared outputs are
partial sums; they are added and all-reduced once (the router and the shared gate are replicated).
"""

from __future__ import annotations

import re

import torch
from torch import nn

from batchinfer.kernels.fused import silu_and_mul
from batchinfer.kernels.moe import fused_moe
from batchinfer.workers.models.model_config import ModelConfig
from batchinfer.workers.parallel.group import TPGroup


class SharedExpert(nn.Module):
    """A dense SwiGLU MLP beside the routed experts (Qwen2-MoE), gate and up fused."""

    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden, 2 * inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, C] -> [T, C]
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class SparseMoeBlock(nn.Module):
    """Top-k routed experts (+ an optional gated shared expert) replacing a layer's MLP."""

    def __init__(self, config: ModelConfig, tp: TPGroup | None = None):
        super().__init__()
        self.tp = tp
        hidden, inter, experts = config.hidden_size, config.moe_intermediate_size, config.num_experts
        self.top_k = config.num_experts_per_tok
        self.renormalize = config.norm_topk_prob
        self.gate = nn.Linear(hidden, experts, bias=False)  # the router
        self.w13 = nn.Parameter(torch.empty(experts, 2 * inter, hidden))
        self.w2 = nn.Parameter(torch.empty(experts, hidden, inter))
        self.shared_expert: SharedExpert | None = None
        self.shared_expert_gate: nn.Linear | None = None
        if config.shared_expert_intermediate_size:
            self.shared_expert = SharedExpert(hidden, config.shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(hidden, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, C] -> [T, C]
        out = fused_moe(x, self.gate(x), self.w13, self.w2, self.top_k, renormalize=self.renormalize)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out if self.tp is None else self.tp.all_reduce(out)


# <layer prefix>.<block>.experts.<N>.<projection>.weight in the checkpoint.
_EXPERT = re.compile(r"(layers\.\d+\.)(?:block_sparse_moe|mlp)\.experts\.(\d+)\.(\w+)\.weight")
_PROJECTIONS = {  # checkpoint projection -> (stacked parameter, part of one expert's slice)
    "w1": ("w13", "gate"), "w3": ("w13", "up"), "w2": ("w2", "down"),
    "gate_proj": ("w13", "gate"), "up_proj": ("w13", "up"), "down_proj": ("w2", "down"),
}
_SHARED = re.compile(r"(layers\.\d+\.)mlp\.shared_expert\.(gate|up)_proj\.weight")


def checkpoint_target(name: str) -> tuple[str, str | None] | None:
    """Our (parameter, part) for an MoE checkpoint tensor (``model.`` already stripped), or None
    when the name is not an MoE tensor. Parts of stacked experts are ``"<N>.gate|up|down"``."""
    match = _EXPERT.fullmatch(name)
    if match and match.group(3) in _PROJECTIONS:
        param, part = _PROJECTIONS[match.group(3)]
        return f"{match.group(1)}mlp.{param}", f"{match.group(2)}.{part}"
    match = _SHARED.fullmatch(name)
    if match:
        return f"{match.group(1)}mlp.shared_expert.gate_up_proj.weight", match.group(2)
    if name.startswith("layers.") and ".block_sparse_moe.gate." in name:  # Mixtral's router
        return name.replace(".block_sparse_moe.", ".mlp."), None
    return None


def part_bounds(config: ModelConfig) -> dict[str, dict[str, tuple[int, ...]]]:
    """Where each part lives in an MoE parameter, keyed by the name after ``layers.N.``:
    ``(expert, row start, row end)`` for stacked experts, ``(row start, row end)`` otherwise."""
    if not config.num_experts:
        return {}
    inter, shared = config.moe_intermediate_size, config.shared_expert_intermediate_size
    w13: dict[str, tuple[int, ...]] = {}
    w2: dict[str, tuple[int, ...]] = {}
    for e in range(config.num_experts):
        w13[f"{e}.gate"], w13[f"{e}.up"] = (e, 0, inter), (e, inter, 2 * inter)
        w2[f"{e}.down"] = (e, 0, config.hidden_size)
    bounds = {"mlp.w13": w13, "mlp.w2": w2}
    if shared:
        bounds["mlp.shared_expert.gate_up_proj.weight"] = {"gate": (0, shared), "up": (shared, 2 * shared)}
    return bounds
