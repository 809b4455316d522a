"""The ``cpu`` backend of ``add_lora``: one matmul pair per segment (adapter) of the step.

The adapter tokens are gathered once in segment order (``index_select`` by ``token_indices``:
each segment is then a contiguous row range). Per segment, one matmul shrinks its rows by all S
slices of its A (only the first ``rank`` rows of each slice: the zero padding of a lower-rank
adapter is skipped), and one matmul per slice expands them, written straight into that slice's
columns of a ``[M, sum(out_i)]`` delta; a single ``index_add_`` adds the delta to ``y``. The
Python loop runs over segments (at most ``L``), never over tokens. Measured on 2 cores, one
gather and one ``index_add_`` per call beat one per segment and slice by 1.3-3x.

Nothing reads a tensor value (the bounds and ranks are the mapping's host tuples), so the same
code runs CUDA tensors too (the fallback when Triton is missing). Matmuls run in the tensors'
dtype (torch accumulates in float32; a low-precision h and delta round once each).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from batchinfer.kernels.lora.mapping import LoRAMapping


def add_lora(
    y: torch.Tensor,  # [T, sum(out_i)]
    x: torch.Tensor,  # [T, in]
    lora_a: torch.Tensor,  # [L, S * R, in]
    lora_b: Sequence[torch.Tensor],  # S x [L, out_i, R]
    mapping: LoRAMapping,
) -> torch.Tensor:
    """Same contract as ``kernels.lora.add_lora`` (inputs already checked)."""
    num_slices = len(lora_b)
    max_rank = lora_a.shape[1] // num_slices
    if mapping.first_row is not None:
        return _add_lora_contiguous(y, x, lora_a, lora_b, mapping, mapping.first_row)
    tokens = mapping.token_indices  # [M]
    x_sorted = x.index_select(0, tokens)  # [M, in], segment k = rows bounds[k]:bounds[k+1]
    delta = torch.empty(tokens.shape[0], y.shape[1], dtype=y.dtype, device=y.device)  # [M, sum(out_i)]
    bounds = mapping.seg_bounds
    for k, slot in enumerate(mapping.seg_slots):
        rank = min(mapping.seg_ranks[k], max_rank)
        rows = slice(bounds[k], bounds[k + 1])
        if rank == 0:
            delta[rows] = 0  # an adapter with nothing to add
            continue
        h = torch.nn.functional.linear(x_sorted[rows], _slot_a(lora_a, slot, rank, num_slices))  # [n, S * r]
        offset = 0
        for i, b in enumerate(lora_b):
            out = b.shape[1]
            torch.matmul(h[:, i * rank:(i + 1) * rank], b[slot, :, :rank].t(),
                         out=delta[rows, offset:offset + out])  # [n, out_i], written in place
            offset += out
    return y.index_add_(0, tokens, delta)


def _slot_a(lora_a: torch.Tensor, slot: int, rank: int, num_slices: int) -> torch.Tensor:  # [S * r, in]
    """Slot ``slot``'s A without the zero padding past ``rank`` in each slice."""
    a = lora_a[slot]  # [S * R, in]
    max_rank = a.shape[0] // num_slices
    if rank == max_rank:
        return a
    return a.view(num_slices, max_rank, -1)[:, :rank].reshape(num_slices * rank, -1)


def _add_lora_contiguous(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor,
                         lora_b: Sequence[torch.Tensor], mapping: LoRAMapping, first: int) -> torch.Tensor:
    """Segments that are row ranges of the step (``mapping.first_row``): each one's shrink reads
    its rows of ``x`` in place and each slice's expand adds into its block of ``y`` in place
    (``addmm_``), so nothing is gathered or scattered (25-40% faster than gather + index_add_ at
    256 decode rows over 8 adapters on 2 cores)."""
    num_slices = len(lora_b)
    max_rank = lora_a.shape[1] // num_slices
    bounds = mapping.seg_bounds
    for k, slot in enumerate(mapping.seg_slots):
        rank = min(mapping.seg_ranks[k], max_rank)
        if rank == 0:
            continue
        rows = slice(first + bounds[k], first + bounds[k + 1])
        h = torch.nn.functional.linear(x[rows], _slot_a(lora_a, slot, rank, num_slices))  # [n, S * r]
        offset = 0
        for i, b in enumerate(lora_b):
            out = b.shape[1]
            y[rows, offset:offset + out].addmm_(h[:, i * rank:(i + 1) * rank], b[slot, :, :rank].t())
            offset += out
    return y
