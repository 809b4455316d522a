"""Pure-torch reference backend: the specification of the attention contract.

Runs on any device and dtype. Clarity over speed: each sequence is gathered from the paged
cache and attended to densely, with softmax in float32.
"""

from __future__ import annotations

import torch


def write_kv(
    k: torch.Tensor,  # [T, KVH, D]
    v: torch.Tensor,  # [T, KVH, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
    slot_mapping: torch.Tensor,  # [T] int; -1 = skip
) -> None:
    """Scatter each token's key and value into its cache slot (block * block_size + offset)."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    block_size = k_cache.shape[1]
    blocks, offsets = slots // block_size, slots % block_size
    k_cache[blocks, offsets] = k[keep].to(k_cache.dtype)
    v_cache[blocks, offsets] = v[keep].to(v_cache.dtype)


def gather_kv(
    cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
    block_table: torch.Tensor,  # [max_blocks] int
    length: int,
) -> torch.Tensor:  # [length, KVH, D]
    """The first ``length`` cached tokens of one sequence, in order."""
    block_size = cache.shape[1]
    num_blocks = (length + block_size - 1) // block_size
    blocks = block_table[:num_blocks].long()
    return cache[blocks].reshape(-1, cache.shape[2], cache.shape[3])[:length]


def paged_attention(
    q: torch.Tensor,  # [Tq, H, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
    block_tables: torch.Tensor,  # [S, max_blocks] int32
    cu_seqlens_q: torch.Tensor,  # [S + 1] int32
    seq_lens: torch.Tensor,  # [S] int32, context length including this step's queries
    scale: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    causal: bool = True,
) -> torch.Tensor:  # [Tq, H, D]
    """Attention of each sequence's queries (its last tokens) over its paged context.

    ``causal``: a query at position p sees keys k <= p (p - W < k <= p with a sliding window W);
    ``causal=False``: it sees all ``seq_lens[i]`` keys (|p - k| < W with a window: symmetric).
    ``softcap`` (Gemma 2): scaled scores become ``softcap * tanh(scores / softcap)`` before the
    mask and the softmax, as transformers' eager attention computes them.
    """
    num_heads, head_dim = q.shape[1], q.shape[2]
    group = num_heads // k_cache.shape[2]
    scale = head_dim**-0.5 if scale is None else scale
    out = torch.empty_like(q)
    cu = cu_seqlens_q.tolist()
    lens = seq_lens.tolist()
    block_size, max_blocks = k_cache.shape[1], block_tables.shape[1]
    if cu[0] != 0 or cu[-1] != q.shape[0]:
        raise ValueError(f"cu_seqlens_q must run from 0 to num_q_tokens={q.shape[0]}, got {cu[0]}..{cu[-1]}")
    for i, length in enumerate(lens):
        start, end = cu[i], cu[i + 1]
        num_q = end - start
        if not 0 <= num_q <= length:
            raise ValueError(f"sequence {i}: {num_q} queries (cu_seqlens_q[{i}:{i + 2}] = {cu[i:i + 2]}) "
                             f"but seq_lens[{i}] = {length}; need 0 <= queries <= seq_len")
        needed = -(-length // block_size)
        if needed > max_blocks:
            raise ValueError(f"sequence {i}: seq_lens[{i}] = {length} needs {needed} blocks "
                             f"but block_tables has {max_blocks} columns")
        if num_q == 0:
            continue
        k = gather_kv(k_cache, block_tables[i], length).float().repeat_interleave(group, dim=1)
        v = gather_kv(v_cache, block_tables[i], length).float().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[start:end].float(), k) * scale  # [H, Lq, L]
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        q_pos = torch.arange(length - num_q, length, device=q.device)[:, None]
        k_pos = torch.arange(length, device=q.device)[None, :]
        visible = (k_pos <= q_pos) | (not causal)  # [Lq, L]
        if sliding_window is not None:
            visible &= k_pos > q_pos - sliding_window
            if not causal:
                visible &= k_pos < q_pos + sliding_window
        scores = scores.masked_fill(~visible, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[start:end] = torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)
    return out
