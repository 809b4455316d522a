"""A decode step's whole layer loop in one call (``layer_loop.cpp``).

At one token a sequence the Python around a layer's ops costs more than several of them: ~200 us a
layer on the ~20M tiny Llama, whose step's matmuls take ~1.3 ms in all. ``decode_layers`` runs
the loop of ``workers/models/decoder.py`` for a plain pre-norm block (RMSNorm, fused qkv, RoPE,
paged attention, SwiGLU; no LoRA, no tensor parallelism) in C++, calling the same ops in the same
order, so its output is the Python path's bit for bit. ``workers/quant/layer_loop.py`` decides
which decoders and which steps take it and lays out the weights.

The library is the decode kernel's (``decode.Build``): one build, one switch,
``BATCHINFER_CPU_DECODE_KERNEL``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from batchinfer.kernels.cpu_ext import decode

# How a linear layer runs (layer_loop.cpp's Kind): as workers/quant's modules run it.
TORCH, GEMV, INT8, INT4 = 0, 1, 2, 3
LINEARS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")  # a layer's linears, in slot order
PER_LINEAR = 4  # weight, qweight, scales (int8) or scales_and_zeros (int4), bias
PER_LAYER = 2 + len(LINEARS) * PER_LINEAR  # input norm, post-attention norm, the linears


def decode_layers(
    x: torch.Tensor,  # [T, C]: the step's embedded tokens, at most one per sequence
    positions: torch.Tensor,  # [T] int
    cos_sin: torch.Tensor,  # [max_positions, rot_dim] float32
    slot_mapping: torch.Tensor,  # [T] int; -1 = skip
    block_tables: torch.Tensor,  # [S, max_blocks] int
    cu_seqlens_q: torch.Tensor,  # [S + 1] int: each sequence 0 or 1 rows
    seq_lens: torch.Tensor,  # [S] int
    k_caches: Sequence[torch.Tensor],  # one [num_blocks, block_size, KVH, D] per layer
    v_caches: Sequence[torch.Tensor],
    weights: Sequence[torch.Tensor | None],  # PER_LAYER a layer, then the final norm's weight
    kinds: Sequence[int],  # len(LINEARS) a layer
    packed_max_rows: Sequence[int],  # len(LINEARS) a layer (read for INT8 / INT4)
    sliding_windows: Sequence[int],  # one a layer, 0 = none
    num_heads: int,
    num_kv_heads: int,
    scale: float,
    eps: float,
) -> torch.Tensor:  # [T, C]: the final norm's output
    """The decoder's layers and final norm over a decode step; the caches get the step's keys and
    values. Raises ``RuntimeError`` for inputs outside the contract (a sequence with two queries,
    a missing weight) and ``IndexError`` for a position, slot or block outside its table."""
    return decode.library().decode_layers(
        x, positions, cos_sin, slot_mapping, block_tables, cu_seqlens_q, seq_lens, k_caches, v_caches,
        weights, kinds, packed_max_rows, sliding_windows, num_heads, num_kv_heads, float(scale), float(eps))
