"""The ``triton`` backend: fused paged attention for a mixed batch (prefill chunks + decodes).

One kernel serves the whole ragged batch. A program owns ``BLOCK_Q`` query tokens of one
sequence and *all* ``GROUP`` query heads that share one KV head, stacked as the ``BLOCK_M``
rows of its tile (row r = query ``r // GROUP``, head ``r % GROUP``), so each KV tile is loaded
once per group of query heads (GQA). It walks the sequence's keys ``TILE_N`` at a time through
the block table with an online softmax: the score matrix is never materialised.

Programs map to sequences without reading lengths on the host (no sync, CUDA-graph safe): the
grid has ``Tq // BLOCK_Q + S`` query blocks, an upper bound; sequence i owns the blocks from
``cu_seqlens_q[i] // BLOCK_Q + i`` on, and each program finds its sequence by binary search.

Split-K (flash-decoding): when a decode batch is too small to fill the GPU, grid axis 2 splits
each sequence's key range; partial outputs and their log-sum-exps are merged by a second kernel.

``CAUSAL=False`` (encoders) lets every query see all its sequence's keys: the key range of a
tile becomes ``[0, seq_len)`` (with a window W, ``|p - k| < W`` around each query position).

Soft-capping (``SOFTCAP``, Gemma 2) maps each raw score ``x = q.k`` to
``cap * tanh(x * scale / cap)``; tanh is built from ``exp2`` (``sign(y) (1 - e) / (1 + e)`` with
``e = exp(-2|y|)``, exact to float32 rounding and portable to the interpreter), then the usual
log2-domain online softmax follows.

Under ``TRITON_INTERPRET=1`` the same kernels run on CPU tensors (the tests do this); matmul
operands are then kept in float32 because the interpreter has no bfloat16 arithmetic.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from batchinfer.kernels.attention_config import AttentionConfig, choose_config

LOG2E = 1.4426950408889634


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    return torch.cuda.get_device_properties(device).multi_processor_count


_TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


@triton.jit
def _paged_attention_kernel(
    out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, cu_q_ptr, seq_lens_ptr,
    part_out_ptr, part_lse_ptr,  # split-K partials: [Tq, H, NUM_SPLITS, HEAD_DIM_PAD], [Tq, H, NUM_SPLITS]
    qk_scale, cap_log2, window, num_seqs, num_heads,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, TILE_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
    USE_WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, CAUSAL: tl.constexpr, DOT_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
):
    # qk_scale: scale * log2(e), or scale / cap with SOFTCAP (then cap_log2 = cap * log2(e)).
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    # Binary search: the last sequence i whose first query block cu_q[i] // BLOCK_Q + i is <= q_block.
    # (Inlined: a helper call costs the interpreter more than the search itself.)
    left = 0
    right = num_seqs
    while left < right:
        mid = (left + right) // 2
        if tl.load(cu_q_ptr + mid) // BLOCK_Q + mid <= q_block:
            left = mid + 1
        else:
            right = mid
    seq = left - 1
    q_start = tl.load(cu_q_ptr + seq)
    num_q = tl.load(cu_q_ptr + seq + 1) - q_start
    first = (q_block - (q_start // BLOCK_Q + seq)) * BLOCK_Q  # first query of this tile, in the sequence
    if first >= num_q:
        return  # a spare block of the upper-bound grid
    seq_len = tl.load(seq_lens_ptr + seq)
    context = seq_len - num_q  # tokens cached before this step's queries

    rows = tl.arange(0, BLOCK_M)
    q_idx = first + rows // GROUP  # [BLOCK_M] query index within the sequence
    head = kv_head * GROUP + rows % GROUP  # [BLOCK_M] query head
    row_ok = (q_idx < num_q) & (rows < BLOCK_Q * GROUP)
    q_pos = context + q_idx  # [BLOCK_M] absolute position (causal mask aligned to the end)
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_ok = dims < HEAD_DIM
    q_tok = (q_start + q_idx).to(tl.int64)
    q = tl.load(q_ptr + q_tok[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0).to(DOT_DTYPE)  # [BLOCK_M, D]

    # Keys this tile's queries can see: [lo, hi). Split-K takes a contiguous share of the tiles.
    last_pos = context + tl.minimum(first + BLOCK_Q, num_q) - 1  # the tile's last query position
    if CAUSAL:
        hi = last_pos + 1
    elif USE_WINDOW:
        hi = tl.minimum(last_pos + window, seq_len)
    else:
        hi = seq_len
    lo = 0
    if USE_WINDOW:
        lo = tl.maximum(context + first - window + 1, 0)
    tile_lo = lo // TILE_N
    num_tiles = tl.cdiv(hi, TILE_N) - tile_lo
    per_split = tl.cdiv(num_tiles, NUM_SPLITS)
    t_begin = tile_lo + split * per_split
    t_end = tl.minimum(t_begin + per_split, tile_lo + num_tiles)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max (log2 domain)
    l_i = tl.zeros([BLOCK_M], tl.float32)  # running sum of exp2
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    cols = tl.arange(0, TILE_N)
    kv_off = kv_head * stride_kh
    for t in range(t_begin, t_end):
        k_pos = t * TILE_N + cols  # [TILE_N]
        k_ok = k_pos < hi  # also keeps block-table reads inside the sequence
        block = tl.load(block_tables_ptr + seq * stride_bt + k_pos // BLOCK_SIZE, mask=k_ok, other=0)
        block = block.to(tl.int64)
        in_block = k_pos % BLOCK_SIZE
        k_ptrs = k_cache_ptr + (block * stride_kb + in_block * stride_ks + kv_off)[None, :] + dims[:, None]
        k_t = tl.load(k_ptrs, mask=k_ok[None, :] & dim_ok[:, None], other=0.0).to(DOT_DTYPE)  # [D, TILE_N]
        s = tl.dot(q, k_t, input_precision=PRECISION) * qk_scale  # [BLOCK_M, TILE_N], log2 domain
        if SOFTCAP:
            e = tl.exp2(-2.8853900817779268 * tl.abs(s))  # exp(-2|s|), s = scores / cap here
            s = tl.where(s < 0, -1.0, 1.0) * (1.0 - e) / (1.0 + e) * cap_log2
        visible = tl.broadcast_to(k_ok[None, :], (BLOCK_M, TILE_N))
        if CAUSAL:
            visible = visible & (k_pos[None, :] <= q_pos[:, None])
        if USE_WINDOW:
            visible = visible & (k_pos[None, :] > q_pos[:, None] - window)
            if not CAUSAL:
                visible = visible & (k_pos[None, :] < q_pos[:, None] + window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v_ptrs = v_cache_ptr + (block * stride_vb + in_block * stride_vs + kv_head * stride_vh)[:, None] \
            + dims[None, :]
        v = tl.load(v_ptrs, mask=k_ok[:, None] & dim_ok[None, :], other=0.0).to(DOT_DTYPE)  # [TILE_N, D]
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v, input_precision=PRECISION)
        m_i = m_new

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    if NUM_SPLITS == 1:
        o_ptrs = out_ptr + q_tok[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :]
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])
    else:
        part = (q_tok * num_heads + head) * NUM_SPLITS + split  # [BLOCK_M]
        tl.store(part_out_ptr + part[:, None] * HEAD_DIM_PAD + dims[None, :], out, mask=row_ok[:, None])
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))
        tl.store(part_lse_ptr + part, lse, mask=row_ok)


@triton.jit
def _merge_splits_kernel(
    out_ptr, part_out_ptr, part_lse_ptr, num_heads, stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, NUM_SPLITS: tl.constexpr,
):
    """out[t, h] = sum_s w_s * o_s / sum_s w_s with w_s = exp2(lse_s - max lse)."""
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    base = (tok * num_heads + head) * NUM_SPLITS
    splits = tl.arange(0, NUM_SPLITS)
    dims = tl.arange(0, HEAD_DIM_PAD)
    lse = tl.load(part_lse_ptr + base + splits)  # [NUM_SPLITS]; -inf for splits with no keys
    w = tl.exp2(lse - tl.max(lse, 0))
    o = tl.load(part_out_ptr + (base + splits)[:, None] * HEAD_DIM_PAD + dims[None, :])  # [S, D]
    out = tl.sum(o * w[:, None], 0) / tl.sum(w, 0)
    tl.store(out_ptr + tok * stride_ot + head * stride_oh + dims, out.to(out_ptr.dtype.element_ty),
             mask=dims < HEAD_DIM)


def paged_attention(
    q: torch.Tensor,  # [Tq, H, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
    block_tables: torch.Tensor,  # [S, max_blocks] int32
    cu_seqlens_q: torch.Tensor,  # [S + 1] int32
    seq_lens: torch.Tensor,  # [S] int32
    scale: float | None = None,
    sliding_window: int | None = None,
    config: AttentionConfig | None = None,
    softcap: float | None = None,
    causal: bool = True,
) -> torch.Tensor:  # [Tq, H, D]
    """The contract's paged attention with the Triton kernels (``config`` overrides the launch
    shape; the tests use it to force several key tiles and split-K on tiny inputs)."""
    num_tokens, num_heads, head_dim = q.shape
    num_seqs = seq_lens.shape[0]
    _, block_size, num_kv_heads, _ = k_cache.shape
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("triton paged_attention needs q, k_cache and v_cache contiguous in head_dim")
    out = torch.empty_like(q)
    if num_tokens == 0 or num_seqs == 0:
        return out
    cfg = config or choose_config(num_tokens, num_seqs, num_heads, num_kv_heads,
                                  block_tables.shape[1] * block_size, _num_sms(q.device))
    if cfg.block_q * (num_heads // num_kv_heads) > cfg.block_m:
        raise ValueError(f"config {cfg} holds fewer rows than block_q x group")
    head_dim_pad = triton.next_power_of_2(max(head_dim, 16))
    interpreting = q.device.type == "cpu"  # CPU tensors only ever run under the interpreter
    dot_dtype = tl.float32 if interpreting else _TL_DTYPES[q.dtype]
    if cfg.num_splits > 1:
        part_out = torch.empty(num_tokens, num_heads, cfg.num_splits, head_dim_pad,
                               dtype=torch.float32, device=q.device)
        part_lse = torch.empty(num_tokens, num_heads, cfg.num_splits, dtype=torch.float32, device=q.device)
    else:
        part_out = part_lse = out  # unused by the kernel
    scale = head_dim**-0.5 if scale is None else scale
    grid = (num_tokens // cfg.block_q + num_seqs, num_kv_heads, cfg.num_splits)
    _paged_attention_kernel[grid](
        out, q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, part_out, part_lse,
        scale * LOG2E if softcap is None else scale / softcap, (softcap or 0.0) * LOG2E,
        sliding_window or 0, num_seqs, num_heads,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
        GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
        BLOCK_SIZE=block_size, BLOCK_M=cfg.block_m, BLOCK_Q=cfg.block_q, TILE_N=cfg.tile_n,
        NUM_SPLITS=cfg.num_splits, USE_WINDOW=sliding_window is not None, SOFTCAP=softcap is not None,
        CAUSAL=causal, DOT_DTYPE=dot_dtype,
        PRECISION="ieee" if dot_dtype == tl.float32 else "tf32",
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if cfg.num_splits > 1:
        _merge_splits_kernel[(num_tokens, num_heads)](
            out, part_out, part_lse, num_heads, out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, NUM_SPLITS=cfg.num_splits,
        )
    return out
