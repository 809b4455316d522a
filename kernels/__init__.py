"""Attention and fused ops over a paged KV cache (the contract in docs/architecture.md).

``write_kv``, ``paged_attention`` and ``varlen_attention`` (packed sequences, no cache: encoders)
dispatch to a backend: ``reference`` (pure torch, any device: the specification), ``cpu``
(batched torch SDPA, default on CPU), ``triton`` (our fused kernels, default on CUDA) or
``flash`` (vllm-flash-attn / flash-attn when importable).
``backend=None`` picks the best one available for the tensors (``available_backends`` lists
them); naming an unavailable one raises ``RuntimeError``.
The decoder's elementwise ops live in ``batchinfer.kernels.fused``. docs/kernels.md has more.
"""

from __future__ import annotations

import torch

from batchinfer.kernels import dispatch, ops
from batchinfer.kernels.dispatch import BACKENDS, available_backends


def write_kv(
    k: torch.Tensor,  # [T, KVH, D]
    v: torch.Tensor,  # [T, KVH, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
    slot_mapping: torch.Tensor,  # [T] int; slot = block * block_size + offset; -1 = skip
    backend: str | None = None,
) -> None:
    """Write keys and values into the paged cache at ``slot_mapping`` (-1 = skip)."""
    if torch.compiler.is_compiling():
        return ops.write_kv_op(k, v, k_cache, v_cache, slot_mapping, backend)
    return dispatch.write_kv(k, v, k_cache, v_cache, slot_mapping, backend)


def paged_attention(
    q: torch.Tensor,  # [Tq, H, D], sequences concatenated
    k_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
    block_tables: torch.Tensor,  # [S, max_blocks] int32
    cu_seqlens_q: torch.Tensor,  # [S + 1] int32, query offsets
    seq_lens: torch.Tensor,  # [S] int32, context length including this step's queries
    scale: float | None = None,  # default head_dim ** -0.5
    sliding_window: int | None = None,  # a query at p sees keys p - W < k <= p
    backend: str | None = None,
    softcap: float | None = None,  # scores -> softcap * tanh(scores / softcap) before the mask (Gemma 2)
    causal: bool = True,  # False: a query sees all seq_lens[i] keys (window W: |p - k| < W)
) -> torch.Tensor:  # [Tq, H, D]
    """Ragged attention of ``q`` over the paged cache; kernels/reference.py is the spec.

    Each sequence's queries are its last tokens; the causal mask is aligned to the end.
    ``causal=False`` (encoders) lets every query see its whole sequence.
    """
    if torch.compiler.is_compiling():
        return ops.paged_attention_op(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens,
                                      scale, sliding_window, backend, softcap, causal)
    return dispatch.paged_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens,
                                    scale, sliding_window, backend, softcap, causal)


def varlen_attention(
    q: torch.Tensor,  # [T, H, D], sequences concatenated
    k: torch.Tensor,  # [T, KVH, D]
    v: torch.Tensor,  # [T, KVH, D]
    cu_seqlens: torch.Tensor,  # [S + 1] int32, token offsets: sequence i is cu_seqlens[i]:cu_seqlens[i+1]
    *,
    causal: bool,
    scale: float | None = None,  # default head_dim ** -0.5
    sliding_window: int | None = None,  # causal: p - W < k <= p; not causal: |p - k| < W
    softcap: float | None = None,
    backend: str | None = None,
) -> torch.Tensor:  # [T, H, D]
    """Attention of packed ragged sequences over their own keys, with no KV cache (encoders with
    ``causal=False``; decoder embedders with ``causal=True``).

    Implemented through ``paged_attention``: k/v viewed as a cache of one-token blocks (no copy),
    every token a query, ``seq_lens`` = the sequences' lengths.
    """
    if torch.compiler.is_compiling():
        return ops.varlen_attention_op(q, k, v, cu_seqlens, causal, scale, sliding_window, softcap, backend)
    return dispatch.varlen_attention(q, k, v, cu_seqlens, causal, scale, sliding_window, softcap, backend)


__all__ = ["BACKENDS", "available_backends", "paged_attention", "varlen_attention", "write_kv"]
