"""``fused_moe``'s input checks and backend choice (the attention backends' names and rules).

Checks read shapes, dtypes and devices only. ``backend=None``: ``cpu`` on CPU, ``triton`` on
CUDA when Triton imports (else ``reference``); the Triton interpreter is never chosen
automatically. An unknown name is a ``ValueError``, an unavailable one a ``RuntimeError``.
"""

from __future__ import annotations

import torch

from batchinfer.kernels import backends

MOE_BACKENDS = ("triton", "reference", "cpu")
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


def unavailable_reason(backend: str, device: torch.device, dtype: torch.dtype | None = None) -> str | None:
    """Why ``backend`` cannot run ``fused_moe`` here, or None when it can."""
    if backend not in MOE_BACKENDS:
        raise ValueError(f"unknown fused_moe backend {backend!r}; expected one of {', '.join(MOE_BACKENDS)}")
    return backends.unavailable_reason(backend, device, dtype)


def select_backend(backend: str | None, device: torch.device, dtype: torch.dtype | None = None) -> str:
    """Resolve ``backend`` (None = automatic) to a backend that can run."""
    if backend is None:
        if device.type == "cpu":
            return "cpu"
        if device.type == "cuda" and unavailable_reason("triton", device, dtype) is None:
            return "triton"
        return "reference"
    reason = unavailable_reason(backend, device, dtype)
    if reason is not None:
        raise RuntimeError(f"fused_moe backend {backend!r} is unavailable: {reason}")
    return backend


def available_backends(device: torch.device | str, dtype: torch.dtype | None = None) -> list[str]:
    """The backends that can run ``fused_moe`` on ``device``, best first."""
    device = torch.device(device)
    order = ("triton", "reference") if device.type == "cuda" else ("cpu", "triton", "reference")
    return [b for b in order if unavailable_reason(b, device, dtype) is None]
