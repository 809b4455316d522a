"""``fused_moe``'s input checks and backend table (the attention backends' checks, selected by
``registry.Family``).

Checks read shapes, dtypes and devices only. ``backend=None``: ``cpu`` on CPU, ``triton`` on
CUDA when Triton imports (else ``reference``); the Triton interpreter is never chosen
automatically. An unknown name is a ``ValueError``, an unavailable one a ``RuntimeError``.
"""

from __future__ import annotations

import torch

from batchinfer.kernels.registry import CPU, REFERENCE, TRITON, Family

ACTIVATIONS = ("silu",)


def check_inputs(
    hidden: torch.Tensor, router_logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, top_k: int,
    activation: str,
) -> None:
    """Raise ``ValueError`` naming the first argument that breaks the contract."""
    if hidden.dim() != 2:
        raise ValueError("fused_moe: hidden must be [num_tokens, hidden_size], "
                         f"got shape {tuple(hidden.shape)}")
    num_tokens, hidden_size = hidden.shape
    if w13.dim() != 3 or w13.shape[2] != hidden_size or w13.shape[1] % 2:
        raise ValueError(f"fused_moe: w13 must be [num_experts, 2 * intermediate, {hidden_size}], "
                         f"got shape {tuple(w13.shape)}")
    num_experts, inter = w13.shape[0], w13.shape[1] // 2
    if w2.shape != (num_experts, hidden_size, inter):
        raise ValueError(f"fused_moe: w2 must be [{num_experts}, {hidden_size}, {inter}] to match w13, "
                         f"got shape {tuple(w2.shape)}")
    if router_logits.shape != (num_tokens, num_experts):
        raise ValueError(f"fused_moe: router_logits must be [{num_tokens}, {num_experts}] "
                         f"(num_tokens, num_experts), got shape {tuple(router_logits.shape)}")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"fused_moe: top_k must be in 1..{num_experts} (num_experts), got {top_k}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"fused_moe: activation {activation!r} is not supported; expected one of "
                         f"{', '.join(ACTIVATIONS)}")
    for name, t in (("router_logits", router_logits), ("w13", w13), ("w2", w2)):
        if t.device != hidden.device:
            raise ValueError(f"fused_moe: {name} is on {t.device} but hidden is on {hidden.device}")
    for name, t in (("w13", w13), ("w2", w2)):
        if t.dtype != hidden.dtype:
            raise ValueError(f"fused_moe: {name} is {t.dtype} but hidden is {hidden.dtype}")
    if not hidden.dtype.is_floating_point:
        raise ValueError(f"fused_moe: hidden must be floating point, got {hidden.dtype}")


MOE = Family("fused_moe", (TRITON, REFERENCE, CPU),
             {"cuda": ("triton", "reference")}, fallback=("cpu", "triton", "reference"))
MOE_BACKENDS = MOE.names  # ("triton", "reference", "cpu")

unavailable_reason = MOE.unavailable_reason
select_backend = MOE.select_backend
available_backends = MOE.available_backends
