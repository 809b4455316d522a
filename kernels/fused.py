"""Fused elementwise ops of the decoder: RMSNorm (+ residual), rotary embedding, SiLU-and-mul.

Each op has a torch implementation (used on CPU and as the reference); CUDA tensors take the
Triton kernels in ``triton_fused`` when Triton is available. Under torch.compile the torch code
is traced instead, and Inductor generates its own fused kernels from it.
"""

from __future__ import annotations

import torch

from batchinfer.kernels import registry


def _use_triton(x: torch.Tensor) -> bool:
    """CUDA tensors in eager mode, with Triton importable."""
    return x.is_cuda and not torch.compiler.is_compiling() and registry.triton_unavailable_reason() is None


def rms_norm(
    x: torch.Tensor,  # [T, C]
    weight: torch.Tensor,  # [C]
    eps: float,
    residual: torch.Tensor | None = None,  # [T, C]
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm as Hugging Face computes it (float32 inside, weight applied in the input dtype).

    With ``residual``: ``x = x + residual`` first, and returns ``(normed, x)`` so the caller
    carries the new residual stream.
    """
    if _use_triton(x):
        from batchinfer.kernels import triton_fused

        return triton_fused.rms_norm(x, weight, eps, residual)
    if residual is not None:
        x = x + residual
        return _rms_norm_torch(x, weight, eps), x
    return _rms_norm_torch(x, weight, eps)


def _rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)  # a new tensor: safe to scale in place
    if weight.dtype == dtype:
        return h.to(dtype).mul_(weight)  # == weight * h.to(dtype), bit for bit, without another copy
    return weight * h.to(dtype)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:  # [T, 2I] -> [T, I]
    """``silu(gate) * up`` for the concatenated ``[gate | up]`` projection."""
    if _use_triton(x):
        from batchinfer.kernels import triton_fused

        return triton_fused.silu_and_mul(x)
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate).mul_(up)  # silu's output is new: multiply in place


def rotary_embedding(
    positions: torch.Tensor,  # [T] int
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, KVH, D]
    cos_sin_cache: torch.Tensor,  # [max_positions, rot_dim]: cos in the first half, sin in the second
    is_neox: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate the first ``rot_dim`` channels of q and k by each token's position.

    ``is_neox``: rotate halves (Llama/Qwen in HF layout); otherwise rotate interleaved pairs (GPT-J).
    """
    if _use_triton(q):
        from batchinfer.kernels import triton_fused

        return triton_fused.rotary_embedding(positions, q, k, cos_sin_cache, is_neox)
    cos, sin = cos_sin_cache[positions.long()].chunk(2, dim=-1)  # [T, rot_dim / 2] each
    return _rotate(q, cos, sin, is_neox), _rotate(k, cos, sin, is_neox)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, is_neox: bool) -> torch.Tensor:
    rot_dim = cos.shape[-1] * 2
    x_rot, x_pass = x[..., :rot_dim], x[..., rot_dim:]
    cos = cos[:, None, :].to(x.dtype)  # [T, 1, rot_dim / 2]
    sin = sin[:, None, :].to(x.dtype)
    if is_neox:
        # Halves written in place: [x1 cos - x2 sin, x2 cos + x1 sin], the same roundings as HF's
        # ``x * cos + rotate_half(x) * sin`` (a + (-b) * s == a - b * s exactly) in fewer passes.
        x1, x2 = x_rot.chunk(2, dim=-1)
        rotated = torch.empty_like(x_rot)
        r1, r2 = rotated.chunk(2, dim=-1)
        torch.mul(x1, cos, out=r1).sub_(x2 * sin)
        torch.mul(x2, cos, out=r2).add_(x1 * sin)
    else:
        x1, x2 = x_rot[..., 0::2], x_rot[..., 1::2]
        rotated = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).flatten(-2)
    return torch.cat([rotated, x_pass], -1) if x_pass.numel() else rotated
