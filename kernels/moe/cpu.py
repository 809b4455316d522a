"""The ``cpu`` backend of ``fused_moe``: tokens grouped by expert, one matmul pair per expert.

The (token, slot) pairs are sorted by expert (a stable argsort), so each expert's tokens are one
contiguous slice of a single gathered ``[T * K, C]`` matrix: the Python loop runs over experts
(at most ``E`` iterations, empty experts skipped), never over tokens. Results are written back
in pair order and summed over each token's K slots in float32.
"""

from __future__ import annotations

import torch

from batchinfer.kernels.fused import silu_and_mul


def fused_experts(
    hidden: torch.Tensor,  # [T, C]
    w13: torch.Tensor,  # [E, 2I, C]
    w2: torch.Tensor,  # [E, C, I]
    topk_weights: torch.Tensor,  # [T, K] float32
    topk_ids: torch.Tensor,  # [T, K] int
) -> torch.Tensor:  # [T, C]
    """Same contract as ``reference.fused_experts``."""
    num_tokens, top_k = topk_ids.shape
    flat = topk_ids.reshape(-1)  # [P], pair p = token p // K, slot p % K
    order = torch.argsort(flat, stable=True)  # pairs grouped by expert
    counts = torch.bincount(flat, minlength=w13.shape[0]).tolist()  # CPU tensor: no device sync
    x = hidden.index_select(0, order // top_k)  # [P, C], each expert's rows contiguous
    y = torch.empty(order.shape[0], w2.shape[1], dtype=hidden.dtype, device=hidden.device)  # [P, C]
    start = 0
    for e, n in enumerate(counts):
        if n:
            rows = slice(start, start + n)
            h = silu_and_mul(torch.nn.functional.linear(x[rows], w13[e]))  # [n, I]
            torch.matmul(h, w2[e].t(), out=y[rows])  # written in place: no copy
            start += n
    unsorted = torch.empty_like(y)
    unsorted[order] = y  # back to pair order: [T, K, C]
    weighted = unsorted.view(num_tokens, top_k, y.shape[1]).float() * topk_weights[..., None]
    return weighted.sum(dim=1).to(hidden.dtype)
