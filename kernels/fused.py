"""Fused elementwise ops of the decoder: RMSNorm (+ residual), rotary embedding, SiLU-and-mul.

Each op has a torch implementation (the reference); CUDA tensors take the Triton kernels in
``triton_fused`` when Triton is available, CPU tensors the compiled ops of ``cpu_ext.elementwise``
when that library builds (one call instead of 7-25 torch ops: at a decode step's one token a
sequence, dispatch is their cost). Under torch.compile the torch code is traced instead, and
Inductor generates its own fused kernels from it.
"""

from __future__ import annotations

import torch

from batchinfer.kernels import registry
from batchinfer.kernels.cpu_ext import elementwise


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
    if (weight.dtype == x.dtype and x.dim() == 2 and x.stride(-1) == 1
            and (residual is None or (residual.dtype == x.dtype and residual.stride(-1) == 1))
            and elementwise.usable(x)):
        return elementwise.rms_norm(x, weight, eps, residual)
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
    if elementwise.silu_and_mul_supported(x):
        return elementwise.silu_and_mul(x)
    return _silu_and_mul_torch(x)


def _silu_and_mul_torch(x: torch.Tensor) -> torch.Tensor:
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


def rotary_embedding_into_cache(
    positions: torch.Tensor,  # [T] int
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, KVH, D]
    v: torch.Tensor,  # [T, KVH, D]
    cos_sin_cache: torch.Tensor,  # [max_positions, rot_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
    slot_mapping: torch.Tensor,  # [T] int; -1 = skip
    backend: str | None = None,
    is_neox: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``rotary_embedding`` then ``kernels.write_kv`` of the rotated keys and the values; returns
    the rotated ``(q, k)``. CPU tensors the compiled op takes are rotated in place (q and k are
    returned themselves) and written in the same call; others take the two steps."""
    if (v.dtype == q.dtype and v.stride(-1) == 1
            and elementwise.rotary_supported(q, k, cos_sin_cache, (k_cache, v_cache))):
        elementwise.rotary_cache(positions, q, k, cos_sin_cache, is_neox, v, k_cache, v_cache, slot_mapping)
        return q, k
    from batchinfer.kernels import write_kv  # the package imports this module

    q, k = rotary_embedding(positions, q, k, cos_sin_cache, is_neox)
    write_kv(k, v, k_cache, v_cache, slot_mapping, backend=backend)
    return q, k


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
