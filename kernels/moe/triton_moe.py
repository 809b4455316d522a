"""The ``triton`` backend of ``fused_moe``: a grouped GEMM over tokens sorted by expert.

``moe_align`` sorts the (token, slot) pairs by expert and pads each expert to ``block_m`` rows,
so a program owns ``block_m`` rows of one expert and ``block_n`` output columns (the expert id
of its block is read from ``expert_ids``). Two launches of one kernel:

1. ``act = silu(x @ w13[e, :I].T) * (x @ w13[e, I:].T)``: the gate and up tiles accumulate side
   by side in one program and the SiLU product is stored, so the ``[P, 2I]`` intermediate never
   exists (x rows are gathered by ``pair // top_k``);
2. ``y = (act @ w2[e].T) * weight``, float32, in pair order; the sum over a token's K slots is
   one torch reduction.

No host reads of tensor values (the grid is an upper bound; spare blocks return at once), so
decode steps can be captured in CUDA graphs. Under ``TRITON_INTERPRET=1`` the same kernel runs on
CPU tensors with float32 dot operands (the interpreter has no bfloat16 arithmetic).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from batchinfer.kernels.moe.align import moe_align


@dataclass(frozen=True)
class MoEConfig:
    """Launch shape of one call: a pure function of shapes (``choose_config``)."""

    block_m: int  # sorted rows per program (one expert each)
    block_n: int  # output columns per program
    block_k: int  # reduction step
    num_warps: int = 4
    num_stages: int = 3


def choose_config(num_pairs: int, num_experts: int) -> MoEConfig:
    """Small blocks when each expert gets few rows (decode: padding would be wasted work), big ones
    for prefill-sized batches (more reuse of every weight tile)."""
    per_expert = num_pairs / max(num_experts, 1)
    if per_expert <= 16:
        return MoEConfig(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=4)
    if per_expert <= 64:
        return MoEConfig(block_m=32, block_n=64, block_k=64, num_warps=4, num_stages=4)
    return MoEConfig(block_m=64, block_n=128, block_k=64, num_warps=8, num_stages=3)


_TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


@triton.jit
def _moe_gemm_kernel(
    out_ptr, a_ptr, b_ptr, sorted_ids_ptr, expert_ids_ptr, num_rows_ptr, weights_ptr,
    num_pairs, N, K, stride_am, stride_be, stride_bn, stride_om,
    A_ROW_DIV: tl.constexpr, GATED: tl.constexpr, MUL_WEIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr,
):
    """out[pair, n] = (a[pair // A_ROW_DIV] @ b[e, n]) (GATED: silu(. @ b[e, n]) * (. @ b[e, N + n]))
    (MUL_WEIGHT: times weights[pair]) for the BLOCK_M sorted pairs of this program's expert e."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_rows_ptr):
        return  # a spare block of the upper-bound grid
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ids_ptr + rows)  # [BLOCK_M]; num_pairs = padding
    row_ok = pair < num_pairs
    a_row = (pair // A_ROW_DIV).to(tl.int64)
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    b_base = b_ptr + expert * stride_be
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        a = tl.load(a_ptr + a_row[:, None] * stride_am + ks[None, :], mask=row_ok[:, None] & k_ok[None, :],
                    other=0.0).to(DOT_DTYPE)  # [BLOCK_M, BLOCK_K]
        b_mask = col_ok[None, :] & k_ok[:, None]
        b = tl.load(b_base + cols[None, :].to(tl.int64) * stride_bn + ks[:, None], mask=b_mask,
                    other=0.0).to(DOT_DTYPE)  # [BLOCK_K, BLOCK_N]
        acc += tl.dot(a, b, input_precision=PRECISION)
        if GATED:
            b_up = tl.load(b_base + (cols[None, :] + N).to(tl.int64) * stride_bn + ks[:, None], mask=b_mask,
                           other=0.0).to(DOT_DTYPE)
            acc_up += tl.dot(a, b_up, input_precision=PRECISION)
    dtype = a_ptr.dtype.element_ty
    if GATED:  # round where the torch spec rounds: each matmul's output, then SiLU
        gate = acc.to(dtype).to(tl.float32)
        silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
        acc = silu * acc_up.to(dtype).to(tl.float32)
    if MUL_WEIGHT:
        w = tl.load(weights_ptr + pair, mask=row_ok, other=0.0)
        acc = acc.to(dtype).to(tl.float32) * w[:, None]
    o_ptrs = out_ptr + pair.to(tl.int64)[:, None] * stride_om + cols[None, :]
    tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def fused_experts(
    hidden: torch.Tensor,  # [T, C]
    w13: torch.Tensor,  # [E, 2I, C]
    w2: torch.Tensor,  # [E, C, I]
    topk_weights: torch.Tensor,  # [T, K] float32
    topk_ids: torch.Tensor,  # [T, K] int
    config: MoEConfig | None = None,
) -> torch.Tensor:  # [T, C]
    """Same contract as ``reference.fused_experts`` (``config`` overrides the launch shape)."""
    num_tokens, top_k = topk_ids.shape
    num_experts, two_inter, hidden_size = w13.shape
    inter = two_inter // 2
    num_pairs = num_tokens * top_k
    if num_pairs == 0:
        return torch.zeros_like(hidden)
    hidden = hidden.contiguous()
    w13, w2 = w13.contiguous(), w2.contiguous()
    weights = topk_weights.to(torch.float32).contiguous()
    cfg = config or choose_config(num_pairs, num_experts)
    sorted_ids, expert_ids, num_rows = moe_align(topk_ids, num_experts, cfg.block_m)
    dot_dtype = tl.float32 if hidden.device.type == "cpu" else _TL_DTYPES[hidden.dtype]
    common = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, DOT_DTYPE=dot_dtype,
                  PRECISION="ieee" if dot_dtype == tl.float32 else "tf32",
                  num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    num_blocks = sorted_ids.shape[0] // cfg.block_m
    act = torch.empty(num_pairs, inter, dtype=hidden.dtype, device=hidden.device)  # [P, I]
    _moe_gemm_kernel[(num_blocks, triton.cdiv(inter, cfg.block_n))](
        act, hidden, w13, sorted_ids, expert_ids, num_rows, weights,
        num_pairs, inter, hidden_size, hidden.stride(0), w13.stride(0), w13.stride(1), act.stride(0),
        A_ROW_DIV=top_k, GATED=True, MUL_WEIGHT=False, **common,
    )
    y = torch.empty(num_pairs, hidden_size, dtype=torch.float32, device=hidden.device)  # [P, C]
    _moe_gemm_kernel[(num_blocks, triton.cdiv(hidden_size, cfg.block_n))](
        y, act, w2, sorted_ids, expert_ids, num_rows, weights,
        num_pairs, hidden_size, inter, act.stride(0), w2.stride(0), w2.stride(1), y.stride(0),
        A_ROW_DIV=1, GATED=False, MUL_WEIGHT=True, **common,
    )
    return y.view(num_tokens, top_k, hidden_size).sum(dim=1).to(hidden.dtype)
