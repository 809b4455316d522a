"""``fused_moe``: a sparse mixture-of-experts feed-forward (top-k routing + SwiGLU experts).

::

    fused_moe(hidden, router_logits, w13, w2, top_k, renormalize=True, activation="silu",
              backend=None) -> [T, C]
        hidden:        [T, C]
        router_logits: [T, E]       softmax in float32, top_k experts per token
        w13:           [E, 2I, C]   gate rows then up rows of every expert, stacked
        w2:            [E, C, I]    down projections
        renormalize:   the top-k weights are divided by their sum (Mixtral; Qwen's norm_topk_prob)

Backends, with the attention backends' names and rules: ``reference`` (``reference.py``, the
specification: one expert at a time), ``cpu`` (``cpu.py``: tokens sorted by expert, one matmul
pair per expert over its contiguous slice; the default on CPU) and ``triton`` (``triton_moe.py``:
a grouped GEMM over expert-sorted, block-padded tokens; the default on CUDA). docs/kernels.md has more.
"""

from __future__ import annotations

import torch

from batchinfer.kernels.moe import cpu, dispatch, reference
from batchinfer.kernels.moe.dispatch import MOE_BACKENDS, available_backends
from batchinfer.kernels.moe.reference import topk_routing


def fused_moe(
    hidden: torch.Tensor,  # [T, C]
    router_logits: torch.Tensor,  # [T, E]
    w13: torch.Tensor,  # [E, 2I, C]
    w2: torch.Tensor,  # [E, C, I]
    top_k: int,
    renormalize: bool = True,
    activation: str = "silu",
    backend: str | None = None,
) -> torch.Tensor:  # [T, C]
    """Each token's ``top_k`` experts, weighted by their (renormalised) router probabilities."""
    dispatch.check_inputs(hidden, router_logits, w13, w2, top_k, activation)
    name = dispatch.select_backend(backend, hidden.device, hidden.dtype)
    weights, ids = topk_routing(router_logits, top_k, renormalize)
    if name == "reference":
        return reference.fused_experts(hidden, w13, w2, weights, ids)
    if name == "cpu":
        return cpu.fused_experts(hidden, w13, w2, weights, ids)
    from batchinfer.kernels.moe import triton_moe

    return triton_moe.fused_experts(hidden, w13, w2, weights, ids)


__all__ = ["MOE_BACKENDS", "available_backends", "fused_moe", "topk_routing"]
