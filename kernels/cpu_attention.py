"""CPU backend for ``paged_attention``: batched decode, explicit-matmul prefill.

Same contract and results as kernels/reference.py (the specification), but built for CPU speed:

- Decode rows go to the compiled kernel of ``kernels/cpu_ext`` when it is available (built on
  first use; ``BATCHINFER_CPU_DECODE_KERNEL``) and takes the tensors: all of them in one call that
  reads K/V straight from the block table, no gather.
- Without it, decode rows (one query) are sorted by context length and grouped into buckets whose padding
  stays under ``PAD_WASTE`` and whose gathered K/V stay under ``BUCKET_BYTES``; each bucket
  costs one block gather and one SDPA call instead of a Python iteration per sequence. A row
  alone in its bucket skips the mask and SDPA (slow on one query row): two ``bmm`` and a softmax
  over exactly its keys. A KV head's ``G`` query heads act as ``G`` query rows over the same
  keys, so grouped-query attention needs no ``repeat_interleave`` copy.
- Prefill chunks (several queries, possibly over a cached prefix) compute scores, mask and
  softmax explicitly, ``PREFILL_CHUNK`` queries at a time over only the keys they can see:
  ~2x faster than CPU SDPA here, whose causal kernel reached ~15 GFLOP/s.
- ``causal=False`` (encoders): prefill chunks see all their sequence's keys (a window W: the
  band |p - k| < W); decode rows are unchanged (a last-position query sees the same keys).
  ``varlen_attention`` (no cache) comes here as one-token blocks: the gather is then a plain
  copy of each sequence's keys (~3% of the attention time; slicing k/v directly was measured).
- Gathered K/V land in reused per-thread workspaces: glibc serves allocations above 32 MiB
  with fresh ``mmap``s, so a new gather tensor per layer page-faults on every step and made
  the gather ~5x slower than the copy itself.

Soft-capping (``softcap``) is applied to the scaled scores before the mask; the SDPA bucket
path cannot apply it, so with a softcap a bucket computes its scores explicitly instead.

Compute is float32 for float16/bfloat16/float8 caches (as in the reference) and float64 for
float64; the output has ``q``'s dtype. Lengths are read with ``.tolist()`` once per call: on
CPU tensors that is a ~2 us copy, not a device sync.

Thread safety: workspaces live in ``threading.local``, so concurrent calls from different
threads never share a buffer; one thread holds at most a few buffers, each sized to the largest
gather it has done (twice that, to absorb growth).
"""

from __future__ import annotations

import functools
import math
import threading

import torch
import torch.nn.functional as F

from batchinfer.kernels.cpu_ext import decode as decode_kernel

PAD_WASTE = 1.25  # a decode bucket may attend over at most 25% padded (masked) key slots
MAX_BUCKET_ROWS = 256  # rows per SDPA call; BUCKET_BYTES bounds the workspace (256 decodes of a 1-layer
# model with ~25-token contexts: 1.11 -> 0.73 ms against 64 rows; longer contexts and 9 heads: 3-5% less)
# Bounds a bucket's gathered K+V: decode attention is memory-bound, and a smaller gather is still
# cache-resident when the scores read it back (16 MiB measured best, from 512 KiB to unbounded,
# on a Xeon with 2 MiB L2 per core). A long context may end up alone: see ``_decode_one``.
BUCKET_BYTES = 16 << 20
PREFILL_CHUNK = 128  # prefill queries per score matrix (keeps [G * chunk, keys] scores cache-resident)

_local = threading.local()


def _workspace(numel: int, dtype: torch.dtype, device: torch.device, slot: str) -> torch.Tensor:
    """A flat buffer of at least ``numel`` elements, reused across calls on this thread."""
    spaces: dict[tuple[str, torch.dtype, torch.device], torch.Tensor]
    spaces = _local.__dict__.setdefault("spaces", {})
    key = (slot, dtype, device)
    buf = spaces.get(key)
    # a buffer made under torch.inference_mode() cannot be written outside it: make a new one then
    stale = buf is not None and buf.is_inference() and not torch.is_inference_mode_enabled()
    if buf is None or stale or buf.numel() < numel:
        buf = spaces[key] = torch.empty(2 * max(numel, 1), dtype=dtype, device=device)
    return buf[:numel]


def _gather(
    cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
    blocks: torch.Tensor,  # [B, nb] int64 block ids
    compute_dtype: torch.dtype,
    slot: str,
) -> torch.Tensor:  # [B, nb * block_size, KVH, D] in compute_dtype, a view of a workspace
    """``cache[blocks]`` flattened per row into reused buffers, converted to ``compute_dtype``."""
    B, nb = blocks.shape
    shape = (B * nb, *cache.shape[1:])
    numel = math.prod(shape)
    raw = _workspace(numel, cache.dtype, cache.device, slot).view(shape)
    torch.index_select(cache, 0, blocks.reshape(-1), out=raw)
    if cache.dtype != compute_dtype:
        converted = _workspace(numel, compute_dtype, cache.device, slot + "/compute").view(shape)
        raw = converted.copy_(raw)
    return raw.view(B, nb * cache.shape[1], *cache.shape[2:])


def _check(cu: list[int], lens: list[int], num_tokens: int, block_size: int, max_blocks: int) -> None:
    """The value checks of the reference backend (same messages), on the host lists."""
    if cu[0] != 0 or cu[-1] != num_tokens:
        raise ValueError(f"cu_seqlens_q must run from 0 to num_q_tokens={num_tokens}, got {cu[0]}..{cu[-1]}")
    for i, length in enumerate(lens):
        num_q = cu[i + 1] - cu[i]
        if not 0 <= num_q <= length:
            raise ValueError(f"sequence {i}: {num_q} queries (cu_seqlens_q[{i}:{i + 2}] = {cu[i:i + 2]}) "
                             f"but seq_lens[{i}] = {length}; need 0 <= queries <= seq_len")
        needed = -(-length // block_size)
        if needed > max_blocks:
            raise ValueError(f"sequence {i}: seq_lens[{i}] = {length} needs {needed} blocks "
                             f"but block_tables has {max_blocks} columns")


def _softcap_(scores: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """``softcap * tanh(scores / softcap)`` in place (no-op for None), as the reference computes it."""
    if softcap is not None:
        scores.div_(softcap).tanh_().mul_(softcap)
    return scores


def decode_buckets(
    rows: list[tuple[int, int]], waste: float = PAD_WASTE, max_rows: int = MAX_BUCKET_ROWS,
    max_keys: int | None = None,
) -> list[list[tuple[int, int]]]:
    """Split ``(sequence, context length)`` pairs into buckets for batched decode.

    Pairs are sorted by length; a bucket is padded to its longest member, and a new bucket
    starts when that padding would exceed ``waste`` times the bucket's real key count, the
    bucket would exceed ``max_rows``, or its padded key slots (rows x longest) would exceed
    ``max_keys`` (a row alone may exceed it). Every pair lands in exactly one bucket.
    """
    buckets: list[list[tuple[int, int]]] = []
    current: list[tuple[int, int]] = []
    real = 0  # sum of the current bucket's lengths
    for seq, length in sorted(rows, key=lambda r: r[1]):
        # Sorted ascending, so ``length`` is the padded length if this row joins.
        padded = (len(current) + 1) * length
        if current and (len(current) >= max_rows or padded > waste * (real + length)
                        or (max_keys is not None and padded > max_keys)):
            buckets.append(current)
            current, real = [], 0
        current.append((seq, length))
        real += length
    if current:
        buckets.append(current)
    return buckets


def _decode(
    q: torch.Tensor, out: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    block_tables: torch.Tensor, cu: list[int], bucket: list[tuple[int, int]], scale: float,
    sliding_window: int | None, compute_dtype: torch.dtype, softcap: float | None = None,
) -> None:
    """Attend one bucket of decode rows (one query each) in a single SDPA call (explicit scores
    with a softcap, which SDPA cannot apply)."""
    _, H, D = q.shape
    bs, KVH = k_cache.shape[1], k_cache.shape[2]
    B, nb = len(bucket), -(-bucket[-1][1] // bs)
    seqs = torch.tensor([s for s, _ in bucket])
    lengths = torch.tensor([n for _, n in bucket])[:, None]  # [B, 1]
    # Columns past a row's own blocks may hold anything (even invalid ids): point them at block 0,
    # whose keys the mask hides anyway.
    tables = block_tables[seqs, :nb].long()  # [B, nb]
    tables = tables.masked_fill(torch.arange(nb)[None, :] >= (lengths + bs - 1) // bs, 0)
    k = _gather(k_cache, tables, compute_dtype, "k")  # [B, L, KVH, D], L = nb * bs
    v = _gather(v_cache, tables, compute_dtype, "v")
    pos = torch.arange(nb * bs)[None, :]  # [1, L]
    visible = pos < lengths  # [B, L]; the query sits at position length - 1
    if sliding_window is not None:
        visible &= pos > lengths - 1 - sliding_window
    rows = torch.tensor([cu[s] for s, _ in bucket])
    qg = q[rows].to(compute_dtype).view(B, KVH, H // KVH, D)  # a KV head's query heads as query rows
    if softcap is None:
        o = F.scaled_dot_product_attention(
            qg, k.transpose(1, 2), v.transpose(1, 2), attn_mask=visible[:, None, None, :], scale=scale,
        )  # [B, KVH, G, D]
    else:
        scores = torch.matmul(qg, k.permute(0, 2, 3, 1)).mul_(scale)  # [B, KVH, G, L]
        scores = _softcap_(scores, softcap).masked_fill_(~visible[:, None, None, :], float("-inf"))
        o = torch.matmul(scores.softmax(-1), v.transpose(1, 2))  # [B, KVH, G, D]
    out[rows] = o.reshape(B, H, D).to(out.dtype)


def _decode_one(
    q: torch.Tensor, out: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    block_table: torch.Tensor, row: int, length: int, scale: float, sliding_window: int | None,
    compute_dtype: torch.dtype, softcap: float | None = None,
) -> None:
    """Attend one decode row over exactly its visible keys: no padding, so no mask."""
    _, H, D = q.shape
    KVH = k_cache.shape[2]
    blocks = block_table[None, :-(-length // k_cache.shape[1])]  # [1, nb]
    lo = 0 if sliding_window is None else max(0, length - sliding_window)
    k = _gather(k_cache, blocks, compute_dtype, "k")[0, lo:length]  # [L, KVH, D]
    v = _gather(v_cache, blocks, compute_dtype, "v")[0, lo:length]
    qg = q[row].to(compute_dtype).view(KVH, H // KVH, D)  # a KV head's query heads as query rows
    # Two batched matmuls and a softmax: ~3x faster than SDPA's CPU kernel on one query row.
    scores = _softcap_(torch.bmm(qg, k.permute(1, 2, 0)).mul_(scale), softcap)  # [KVH, G, L]
    o = torch.bmm(scores.softmax(-1), v.transpose(0, 1))  # [KVH, G, D]
    out[row] = o.view(H, D).to(out.dtype)


def _prefill(
    q: torch.Tensor, out: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    block_table: torch.Tensor, start: int, end: int, length: int, scale: float,
    sliding_window: int | None, compute_dtype: torch.dtype, softcap: float | None = None,
    causal: bool = True,
) -> None:
    """Attend one sequence's query chunk ``q[start:end]`` (its last tokens) over its paged context."""
    nb = -(-length // k_cache.shape[1])
    blocks = block_table[None, :nb].long()  # [1, nb]
    k = _gather(k_cache, blocks, compute_dtype, "k")[0, :length].transpose(0, 1)  # [KVH, L, D]
    v = _gather(v_cache, blocks, compute_dtype, "v")[0, :length].transpose(0, 1)
    _attend(q[start:end], out[start:end], k, v, scale, sliding_window, compute_dtype, softcap, causal)


@functools.cache
def _ahead(n: int) -> torch.Tensor:
    """[n, n] True where key j is after query i (j > i): a chunk's causal mask over its own keys."""
    return torch.ones(n, n, dtype=torch.bool).triu_(1)


def _attend(
    q: torch.Tensor,  # [Lq, H, D]: the sequence's last Lq tokens
    out: torch.Tensor,  # [Lq, H, D], written
    k: torch.Tensor,  # [KVH, L, D] in compute_dtype (any strides with a unit last one)
    v: torch.Tensor,  # [KVH, L, D]
    scale: float, sliding_window: int | None, compute_dtype: torch.dtype, softcap: float | None,
    causal: bool,
) -> None:
    """Dense attention of several queries over one sequence's keys.

    Explicit scores and softmax per ``PREFILL_CHUNK`` queries, each over only the keys its
    queries can see (CPU SDPA ran this at ~15 GFLOP/s; batched matmuls reach ~150). A KV head's
    ``G`` query heads are stacked as ``G * chunk`` query rows over the same keys.
    """
    num_q, H, D = q.shape
    KVH, length = k.shape[0], k.shape[1]
    G = H // KVH
    qh = q.to(compute_dtype).permute(1, 0, 2).reshape(KVH, G, num_q, D)  # [KVH, G, Lq, D]
    first = length - num_q  # position of the first query
    for c0 in range(0, num_q, PREFILL_CHUNK):
        c1 = min(c0 + PREFILL_CHUNK, num_q)
        n = c1 - c0
        # Keys the chunk's queries (positions first + c0 .. first + c1 - 1) can see: [k_lo, k_hi).
        if causal:
            k_hi = first + c1
        else:
            k_hi = length if sliding_window is None else min(length, first + c1 - 1 + sliding_window)
        k_lo = 0 if sliding_window is None else max(0, first + c0 - sliding_window + 1)
        hidden = None  # [n, Lk] keys inside [k_lo, k_hi) that a query still cannot see
        if sliding_window is not None:
            q_pos = torch.arange(first + c0, first + c1)[:, None]  # [n, 1]
            k_pos = torch.arange(k_lo, k_hi)[None, :]  # [1, Lk]
            hidden = k_pos <= q_pos - sliding_window
            hidden |= k_pos > q_pos if causal else k_pos >= q_pos + sliding_window
        qc = qh[:, :, c0:c1].reshape(KVH, G * n, D)
        scores = torch.bmm(qc, k[:, k_lo:k_hi].transpose(1, 2)).mul_(scale)  # [KVH, G * n, Lk]
        _softcap_(scores, softcap)
        if hidden is not None:
            scores.view(KVH, G, n, -1).masked_fill_(hidden, float("-inf"))
        elif causal:  # only the chunk's own keys, the last n, can be ahead of its queries: mask that corner
            scores.view(KVH, G, n, -1)[..., -n:].masked_fill_(_ahead(n), float("-inf"))
        o = torch.bmm(scores.softmax(-1), v[:, k_lo:k_hi])  # [KVH, G * n, D]
        out[c0:c1] = o.view(H, n, D).transpose(0, 1).to(out.dtype)


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

    A decode row's one query sits at its sequence's last position, where causal and non-causal
    attention see the same keys: only prefill chunks look at ``causal``. CPU tensors only
    (``dispatch`` checks shapes, devices and that q/k/v share a dtype).
    """
    scale = q.shape[2] ** -0.5 if scale is None else scale
    compute_dtype = torch.float64 if k_cache.dtype == torch.float64 else torch.float32
    cu, lens = cu_seqlens_q.tolist(), seq_lens.tolist()
    _check(cu, lens, q.shape[0], k_cache.shape[1], block_tables.shape[1])
    out = torch.empty_like(q)
    decodes = [(i, n) for i, n in enumerate(lens) if cu[i + 1] - cu[i] == 1]
    if decodes and decode_kernel.enabled(q, k_cache, v_cache):  # all decode rows in one compiled call
        decode_kernel.paged_decode(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale, out,
                                   sliding_window, softcap)
        decodes = []
    slot_bytes = 2 * math.prod(k_cache.shape[2:]) * compute_dtype.itemsize  # one key slot of K + V, gathered
    for bucket in decode_buckets(decodes, max_keys=BUCKET_BYTES // slot_bytes):
        if len(bucket) == 1:
            (i, length), = bucket
            _decode_one(q, out, k_cache, v_cache, block_tables[i], cu[i], length, scale, sliding_window,
                        compute_dtype, softcap)
        else:
            _decode(q, out, k_cache, v_cache, block_tables, cu, bucket, scale, sliding_window, compute_dtype,
                    softcap)
    for i, length in enumerate(lens):
        if cu[i + 1] - cu[i] > 1:  # zero-query sequences need nothing; decodes are done
            _prefill(q, out, k_cache, v_cache, block_tables[i], cu[i], cu[i + 1], length, scale,
                     sliding_window, compute_dtype, softcap, causal)
    return out
