"""The ``triton`` backend of ``add_lora``: Punica / S-LoRA segmented matmuls, shrink then expand.

The mapping's host-built ``block_table`` cuts every segment (the tokens of one adapter slot) into
blocks of ``block_m`` rows, each row ``(start, end, slot, rank)``; a program owns one block, so
its slot is one load and nothing is read back on the host (no device sync; the grid is the table's
length, known on the host).

1. shrink: ``h[p] = x[token_indices[p]] @ lora_a[slot].T`` for every sorted row p, all S slices in
   one pass over x (``[M, S * R]``, float32); grid (blocks, column tiles of S * R, split-K parts:
   a decode step has few blocks, so the ``in`` reduction is split and atomically added);
2. expand, once per slice i: ``y[token, off_i + n] += h[p, i*R:(i+1)*R] @ lora_b[i][slot, n].T``
   in float32, the delta rounded to y's dtype then added (where the reference rounds); grid
   (blocks, column tiles of out_i).

Only the first ``rank`` rows of each A slice and columns of each B are loaded (a lower-rank
adapter's zero padding costs no bandwidth). Tokens of no adapter are in no block: never touched.
Under ``TRITON_INTERPRET=1`` the kernels run on CPU tensors with float32 dot operands (the
interpreter has no bfloat16 arithmetic).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from batchinfer.kernels.lora.mapping import LoRAMapping, block_table_np


@dataclass(frozen=True)
class LoRAConfig:
    """Launch shape of one call: a pure function of shapes (``choose_config``)."""

    shrink_block_n: int  # columns of h (of S * R) per shrink program
    shrink_block_k: int  # reduction step over in_features
    split_k: int  # shrink programs sharing one block's reduction (float32 atomics when > 1)
    expand_block_n: int  # output columns per expand program
    num_warps: int = 4
    num_stages: int = 2


SHRINK_PROGRAMS = 256  # enough shrink programs to fill an H100/H200 (132 SMs) about twice


def choose_config(num_blocks: int, shrink_cols: int, in_features: int) -> LoRAConfig:
    """All of S * R in one shrink tile when it fits (x is read once); split the reduction when
    there are too few blocks to fill the GPU (decode: a block or two per adapter), keeping at
    least 4 steps of ``block_k`` per part."""
    block_n = min(128, max(16, triton.next_power_of_2(shrink_cols)))
    block_k = 64
    programs = num_blocks * triton.cdiv(shrink_cols, block_n)
    max_split = max(1, in_features // (4 * block_k))
    split_k = max(1, min(max_split, SHRINK_PROGRAMS // max(programs, 1)))
    return LoRAConfig(shrink_block_n=block_n, shrink_block_k=block_k, split_k=split_k, expand_block_n=128)


_TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


@triton.jit
def _block_row(table_ptr, pid_b):
    """Block ``pid_b``'s row of the block table: its rows' start, its segment's end, slot, rank."""
    row = table_ptr + pid_b * 4
    return tl.load(row), tl.load(row + 1), tl.load(row + 2), tl.load(row + 3)


@triton.jit
def _shrink_kernel(
    h_ptr, x_ptr, a_ptr, token_indices_ptr, table_ptr,
    N, K, R, split_k, stride_xm, stride_xk, stride_al, stride_an, stride_ak, stride_hm,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ATOMIC: tl.constexpr,
    DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr,
):
    """h[p, n] (+)= x[token_indices[p]] . a[slot, n] for this block's rows p, the n < N (= S * R)
    of this tile whose row in their slice (n % R) is below the block's rank; program k of
    ``split_k`` takes every split_k-th step of the reduction (ATOMIC: added into a zeroed h)."""
    pid_b = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    start, end, slot, rank = _block_row(table_ptr, pid_b)
    if rank == 0:
        return
    rows = start + tl.arange(0, BLOCK_M)  # [BLOCK_M] sorted positions
    row_ok = rows < end
    tokens = tl.load(token_indices_ptr + rows, mask=row_ok, other=0)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_live = (cols < N) & (cols % R < rank)
    a_base = a_ptr + slot * stride_al
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(pid_k * BLOCK_K, K, BLOCK_K * split_k):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        xs = tl.load(x_ptr + tokens[:, None] * stride_xm + ks[None, :] * stride_xk,
                     mask=row_ok[:, None] & k_ok[None, :], other=0.0).to(DOT_DTYPE)  # [BLOCK_M, BLOCK_K]
        a = tl.load(a_base + cols[None, :] * stride_an + ks[:, None] * stride_ak,
                    mask=col_live[None, :] & k_ok[:, None], other=0.0).to(DOT_DTYPE)  # [BLOCK_K, BLOCK_N]
        acc += tl.dot(xs, a, input_precision=PRECISION)
    h_ptrs = h_ptr + rows[:, None] * stride_hm + cols[None, :]
    h_mask = row_ok[:, None] & (cols < N)[None, :]
    if ATOMIC:
        tl.atomic_add(h_ptrs, acc, mask=h_mask)
    else:
        tl.store(h_ptrs, acc, mask=h_mask)


@triton.jit
def _expand_kernel(
    y_ptr, h_ptr, b_ptr, token_indices_ptr, table_ptr,
    N, h_col0, y_col0, stride_ym, stride_yn, stride_hm, stride_bl, stride_bn, stride_br,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
):
    """y[token, y_col0 + n] += round(h[p, h_col0 + r] . b[slot, n, r]) over r < rank, for this
    block's rows p (token = token_indices[p]) and this tile's n < N."""
    pid_b = tl.program_id(0)
    pid_n = tl.program_id(1)
    start, end, slot, rank = _block_row(table_ptr, pid_b)
    if rank == 0:
        return
    rows = start + tl.arange(0, BLOCK_M)
    row_ok = rows < end
    tokens = tl.load(token_indices_ptr + rows, mask=row_ok, other=0)
    rs = tl.arange(0, BLOCK_R)
    r_ok = rs < rank
    h = tl.load(h_ptr + rows[:, None] * stride_hm + h_col0 + rs[None, :],
                mask=row_ok[:, None] & r_ok[None, :], other=0.0)  # [BLOCK_M, BLOCK_R] float32
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    b = tl.load(b_ptr + slot * stride_bl + cols[None, :] * stride_bn + rs[:, None] * stride_br,
                mask=col_ok[None, :] & r_ok[:, None], other=0.0).to(tl.float32)  # [BLOCK_R, BLOCK_N]
    delta = tl.dot(h, b, input_precision="ieee")
    y_ptrs = y_ptr + tokens[:, None] * stride_ym + (y_col0 + cols[None, :]) * stride_yn
    mask = row_ok[:, None] & col_ok[None, :]
    dtype = y_ptr.dtype.element_ty
    y = tl.load(y_ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptrs, (y + delta.to(dtype).to(tl.float32)).to(dtype), mask=mask)


def block_table(mapping: LoRAMapping, device: torch.device) -> torch.Tensor:  # [NB, 4] int64
    """The mapping's block table (built here, one copy per call, when the mapping has none)."""
    if mapping.block_table is not None:
        return mapping.block_table
    table = block_table_np(mapping.seg_bounds, mapping.seg_slots, mapping.seg_ranks, mapping.block_m)
    return torch.from_numpy(table).to(device)


def add_lora(
    y: torch.Tensor,  # [T, sum(out_i)]
    x: torch.Tensor,  # [T, in]
    lora_a: torch.Tensor,  # [L, S * R, in]
    lora_b: Sequence[torch.Tensor],  # S x [L, out_i, R]
    mapping: LoRAMapping,
    config: LoRAConfig | None = None,
) -> torch.Tensor:
    """Same contract as ``kernels.lora.add_lora`` (inputs already checked; ``config`` overrides
    the launch shape)."""
    block_m = mapping.block_m
    if block_m < 16 or block_m & (block_m - 1):
        raise ValueError(f"add_lora (triton): mapping.block_m must be a power of two >= 16, got {block_m}")
    table = block_table(mapping, y.device)
    num_blocks = table.shape[0]
    num_tokens_used = mapping.token_indices.shape[0]
    if num_blocks == 0 or num_tokens_used == 0:
        return y
    num_slices = len(lora_b)
    shrink_cols, in_features = lora_a.shape[1], lora_a.shape[2]
    max_rank = shrink_cols // num_slices
    cfg = config or choose_config(num_blocks, shrink_cols, in_features)
    interpreted = y.device.type == "cpu"
    dot_dtype = tl.float32 if interpreted else _TL_DTYPES[x.dtype]
    alloc = torch.zeros if cfg.split_k > 1 else torch.empty
    h = alloc(num_tokens_used, shrink_cols, dtype=torch.float32, device=y.device)  # [M, S * R]
    _shrink_kernel[(num_blocks, triton.cdiv(shrink_cols, cfg.shrink_block_n), cfg.split_k)](
        h, x, lora_a, mapping.token_indices, table,
        shrink_cols, in_features, max_rank, cfg.split_k, x.stride(0), x.stride(1),
        lora_a.stride(0), lora_a.stride(1), lora_a.stride(2), h.stride(0),
        BLOCK_M=block_m, BLOCK_N=cfg.shrink_block_n, BLOCK_K=cfg.shrink_block_k, ATOMIC=cfg.split_k > 1,
        DOT_DTYPE=dot_dtype, PRECISION="ieee" if dot_dtype == tl.float32 else "tf32",
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    block_r = max(16, triton.next_power_of_2(max_rank))
    offset = 0
    for i, b in enumerate(lora_b):
        out = b.shape[1]
        _expand_kernel[(num_blocks, triton.cdiv(out, cfg.expand_block_n))](
            y, h, b, mapping.token_indices, table,
            out, i * max_rank, offset, y.stride(0), y.stride(1), h.stride(0),
            b.stride(0), b.stride(1), b.stride(2),
            BLOCK_M=block_m, BLOCK_N=cfg.expand_block_n, BLOCK_R=block_r,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
        offset += out
    return y
