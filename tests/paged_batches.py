"""Random paged batches and a naive dense attention, shared by the kernel tests and benchmarks.

``make_paged_batch`` lays each sequence's keys/values into randomly chosen (shuffled, never
contiguous) cache blocks with ``reference.write_kv`` and keeps the dense copies, so any backend
can be checked against ``dense_attention`` built from the very same K/V. ``make_packed`` and
``dense_varlen`` do the same for ``varlen_attention`` (packed sequences, no cache).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from batchinfer.kernels import reference


@dataclass
class PagedBatch:
    """One step's attention inputs plus the dense per-sequence K/V they were built from."""

    q: torch.Tensor  # [Tq, H, D]
    k_cache: torch.Tensor  # [num_blocks, block_size, KVH, D]
    v_cache: torch.Tensor  # [num_blocks, block_size, KVH, D]
    block_tables: torch.Tensor  # [S, max_blocks] int32
    cu_seqlens_q: torch.Tensor  # [S + 1] int32
    seq_lens: torch.Tensor  # [S] int32
    keys: list[torch.Tensor]  # per sequence [L_i, KVH, D]
    values: list[torch.Tensor]  # per sequence [L_i, KVH, D]

    def args(self) -> tuple[torch.Tensor, ...]:
        """Positional arguments of ``paged_attention`` in contract order."""
        return (self.q, self.k_cache, self.v_cache, self.block_tables, self.cu_seqlens_q, self.seq_lens)


def make_paged_batch(
    seqs: list[tuple[int, int]],  # per sequence (context length incl. queries, number of queries)
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    spare_blocks: int = 3,
    generator: torch.Generator | None = None,
) -> PagedBatch:
    """A ragged batch over a paged cache with ``spare_blocks`` unused (garbage-filled) blocks."""
    for i, (length, num_q) in enumerate(seqs):
        if not 0 <= num_q <= length:
            raise ValueError(f"sequence {i}: need 0 <= num_q <= length, got ({length}, {num_q})")
    gen = generator or torch.Generator().manual_seed(0)
    blocks_per_seq = [-(-length // block_size) for length, _ in seqs]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    max_blocks = max(blocks_per_seq + [1])

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype=dtype, device=device)

    # Garbage everywhere first: a kernel reading a slot it should not will show it.
    k_cache = randn(num_blocks, block_size, num_kv_heads, head_dim) * 10
    v_cache = randn(num_blocks, block_size, num_kv_heads, head_dim) * 10
    order = torch.randperm(num_blocks, generator=gen)
    block_tables = torch.zeros(len(seqs), max_blocks, dtype=torch.int32)
    keys, values, queries = [], [], []
    used = 0
    for i, (length, num_q) in enumerate(seqs):
        blocks = order[used:used + blocks_per_seq[i]]
        used += blocks_per_seq[i]
        block_tables[i, : len(blocks)] = blocks.to(torch.int32)
        k, v = randn(length, num_kv_heads, head_dim), randn(length, num_kv_heads, head_dim)
        positions = torch.arange(length)
        slots = (blocks[positions // block_size] * block_size + positions % block_size).to(device)
        reference.write_kv(k, v, k_cache, v_cache, slots)
        keys.append(k)
        values.append(v)
        queries.append(randn(num_q, num_heads, head_dim))
    num_qs = torch.tensor([n for _, n in seqs], dtype=torch.int32)
    cu = torch.zeros(len(seqs) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(num_qs, 0)
    return PagedBatch(
        q=torch.cat(queries) if queries else randn(0, num_heads, head_dim),
        k_cache=k_cache, v_cache=v_cache,
        block_tables=block_tables.to(device), cu_seqlens_q=cu.to(device),
        seq_lens=torch.tensor([n for n, _ in seqs], dtype=torch.int32, device=device),
        keys=keys, values=values,
    )


def dense_attention(
    q: torch.Tensor,  # [Lq, H, D]: the last Lq tokens of the sequence
    k: torch.Tensor,  # [L, KVH, D]
    v: torch.Tensor,  # [L, KVH, D]
    scale: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    causal: bool = True,
) -> torch.Tensor:  # [Lq, H, D] float32
    """Textbook attention in float64 (torch SDPA, math kernel) with an explicit boolean mask built
    from ``tril``/``triu`` — a construction independent of the backends': the tests' ground truth.
    With ``softcap`` the float64 scores are capped (``cap * tanh(s / cap)``) and softmaxed by hand.
    ``causal=False``: every query sees every key (with a window W: the band |p - k| < W)."""
    num_q, num_heads, head_dim = q.shape
    length, group = k.shape[0], num_heads // k.shape[1]
    scale = head_dim**-0.5 if scale is None else scale
    ones = torch.ones(num_q, length, dtype=torch.bool, device=q.device)
    offset = length - num_q  # query i sits at position offset + i
    if causal:
        mask = ones.tril(diagonal=offset)
    else:
        mask = ones if sliding_window is None else ones.tril(diagonal=offset + sliding_window - 1)
    if sliding_window is not None:
        mask &= ones.triu(diagonal=offset - sliding_window + 1)
    k = k.double().repeat_interleave(group, dim=1).transpose(0, 1)  # [H, L, D]
    v = v.double().repeat_interleave(group, dim=1).transpose(0, 1)
    qd = q.double().transpose(0, 1)  # [H, Lq, D]
    if softcap is None:
        out = torch.nn.functional.scaled_dot_product_attention(qd, k, v, attn_mask=mask, scale=scale)
    else:
        scores = softcap * torch.tanh(qd @ k.transpose(1, 2) * scale / softcap)  # [H, Lq, L]
        out = scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v  # [H, Lq, D]
    return out.transpose(0, 1).float()


def dense_reference(batch: PagedBatch, scale: float | None = None, sliding_window: int | None = None,
                    softcap: float | None = None, causal: bool = True) -> torch.Tensor:  # [Tq, H, D] float32
    """``dense_attention`` for every sequence of ``batch``, concatenated like ``batch.q``."""
    cu = batch.cu_seqlens_q.tolist()
    outs = [dense_attention(batch.q[cu[i]:cu[i + 1]], batch.keys[i], batch.values[i], scale, sliding_window,
                            softcap, causal)
            for i in range(len(batch.keys))]
    return torch.cat(outs) if outs else batch.q.float()


def make_packed(
    lengths: list[int], num_heads: int, num_kv_heads: int, head_dim: int,
    dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random packed sequences for ``varlen_attention``: ``(q [T, H, D], k [T, KVH, D], v, cu_seqlens
    [S + 1] int32)``; k and v are strided views of one fused [T, 2, KVH, D] tensor, as a model's
    fused projection gives them."""
    gen = generator or torch.Generator().manual_seed(0)
    total = sum(lengths)
    q = torch.randn(total, num_heads, head_dim, generator=gen).to(dtype=dtype, device=device)
    kv = torch.randn(total, 2, num_kv_heads, head_dim, generator=gen).to(dtype=dtype, device=device)
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int32), 0)
    return q, kv[:, 0], kv[:, 1], cu.to(device)


def dense_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, causal: bool,
                 scale: float | None = None, sliding_window: int | None = None,
                 softcap: float | None = None) -> torch.Tensor:  # [T, H, D] float32
    """``dense_attention`` of each packed sequence over its own keys (every token a query)."""
    cu = cu_seqlens.tolist()
    outs = [dense_attention(q[a:b], k[a:b], v[a:b], scale, sliding_window, softcap, causal) if b > a
            else q[a:b].float() for a, b in zip(cu[:-1], cu[1:], strict=True)]
    return torch.cat(outs) if outs else q.float()


def failures_in_threads(check: Callable[[int], bool], count: int = 4, rounds: int = 10) -> list[int]:
    """Run ``check(i)`` ``rounds`` times on each of ``count`` threads at once (thread i passes i);
    the indices of the calls that returned False (a backend sharing state across threads)."""
    failures: list[int] = []

    def work(i: int) -> None:
        failures.extend(i for _ in range(rounds) if not check(i))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return failures
