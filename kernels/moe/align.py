"""``moe_align``: the (token, slot) pairs sorted by expert, each expert padded to the block size.

The Triton grouped GEMM runs one program per ``block_m`` sorted rows, all of one expert, so it
needs: the pair index of every sorted row (``num_pairs`` marks padding), the expert of every
block, and how many rows are real blocks. Everything is computed on the device with tensor ops
and a grid sized by an upper bound, never by reading counts on the host (no sync: CUDA graphs
can capture it).
"""

from __future__ import annotations

import torch


def max_padded_rows(num_pairs: int, num_experts: int, block_m: int) -> int:
    """An upper bound of the padded row count (at most min(P, E) experts get rows), rounded up to a block."""
    bound = num_pairs + min(num_pairs, num_experts) * (block_m - 1)
    return -(-bound // block_m) * block_m


def moe_align(
    topk_ids: torch.Tensor,  # [T, K] int
    num_experts: int,
    block_m: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(sorted_ids [R] int32, expert_ids [R // block_m] int32, num_rows [1] int32)``.

    Rows ``[0, num_rows)`` hold each expert's pairs (in pair order) padded with ``P`` to a multiple
    of ``block_m``; rows past ``num_rows`` are padding whose blocks the kernel skips.
    """
    flat = topk_ids.reshape(-1).long()
    num_pairs = flat.numel()
    device = flat.device
    counts = torch.zeros(num_experts, dtype=torch.long, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # bincount reads the max on the host
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)
    sorted_experts = flat[order]
    first = torch.cumsum(counts, 0) - counts  # each expert's first pair in sorted order
    rank = torch.arange(num_pairs, device=device) - first[sorted_experts]
    dest = (ends - padded)[sorted_experts] + rank
    rows = max_padded_rows(num_pairs, num_experts, block_m)
    sorted_ids = torch.full((rows,), num_pairs, dtype=torch.int32, device=device)
    sorted_ids[dest] = order.to(torch.int32)
    block_starts = torch.arange(0, rows, block_m, device=device)
    expert_ids = torch.searchsorted(ends, block_starts, right=True).clamp_(max=num_experts - 1)
    return sorted_ids, expert_ids.to(torch.int32), ends[-1:].to(torch.int32)
