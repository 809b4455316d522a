"""Triton versions of the decoder's elementwise ops (``kernels/fused.py`` is their spec).

Each kernel computes in float32 and rounds where the torch spec rounds (the residual sum, the
normalised activations before the weight, SiLU before the product, cos/sin to the input dtype),
so results match the torch path to the last bit or two. Rows are tokens: one program per token.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    out_ptr, res_out_ptr, x_ptr, res_ptr, w_ptr, eps, num_cols, stride_x, stride_r,
    HAS_RESIDUAL: tl.constexpr, BLOCK_C: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_C)
    mask = cols < num_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)  # [C]
    if HAS_RESIDUAL:
        x += tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        x_rounded = x.to(res_out_ptr.dtype.element_ty)  # the new residual stream, as torch's add rounds it
        tl.store(res_out_ptr + row * num_cols + cols, x_rounded, mask=mask)
        x = x_rounded.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x * x, 0) / num_cols + eps)
    h = (x * inv_rms).to(x_ptr.dtype.element_ty).to(tl.float32)  # HF casts back before the weight
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * num_cols + cols, (w * h).to(out_ptr.dtype.element_ty), mask=mask)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as ``[rows, C]`` with unit stride in C (a view when possible, else a copy)."""
    t = t.reshape(-1, t.shape[-1])
    return t if t.stride(-1) == 1 else t.contiguous()


def rms_norm(
    x: torch.Tensor,  # [..., C]
    weight: torch.Tensor,  # [C]
    eps: float,
    residual: torch.Tensor | None = None,  # [..., C]
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Same contract as ``fused.rms_norm``: ``normed`` or ``(normed, x + residual)``."""
    shape = x.shape
    in_dtype = x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)
    x2 = _rows(x.to(in_dtype))  # [R, C]
    res2 = _rows(residual) if residual is not None else x2
    num_rows, num_cols = x2.shape
    out = torch.empty(shape, dtype=torch.promote_types(weight.dtype, in_dtype), device=x.device)
    res_out = out if residual is None else torch.empty(shape, dtype=in_dtype, device=x.device)
    block_c = triton.next_power_of_2(num_cols)
    if num_rows:
        _rms_norm_kernel[(num_rows,)](
            out, res_out, x2, res2, weight, eps, num_cols, x2.stride(0), res2.stride(0),
            HAS_RESIDUAL=residual is not None, BLOCK_C=block_c, num_warps=min(max(block_c // 512, 1), 16),
        )
    return out if residual is None else (out, res_out)


@triton.jit
def _silu_and_mul_kernel(out_ptr, x_ptr, num_cols, stride_x, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < num_cols
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + num_cols + cols, mask=mask, other=0.0).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * num_cols + cols, (silu * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:  # [..., 2I] -> [..., I]
    """``silu(gate) * up`` for the concatenated ``[gate | up]`` projection."""
    if x.shape[-1] % 2:
        raise ValueError(f"silu_and_mul needs an even last dim, got shape {tuple(x.shape)}")
    x2 = _rows(x)
    num_rows, half = x2.shape[0], x2.shape[1] // 2
    out = torch.empty(*x.shape[:-1], half, dtype=x.dtype, device=x.device)
    block = min(triton.next_power_of_2(max(half, 1)), 1024)
    if num_rows and half:
        _silu_and_mul_kernel[(num_rows, triton.cdiv(half, block))](out, x2, half, x2.stride(0), BLOCK=block)
    return out


@triton.jit
def _rotate_heads(
    out_ptr, x_ptr, cos, sin, tok, num_heads, stride_xt, stride_xh, stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, ROT_HALF: tl.constexpr, IS_NEOX: tl.constexpr,
    HEADS_PAD: tl.constexpr, HALF_PAD: tl.constexpr, PASS_PAD: tl.constexpr,
):
    """Rotate every head of one token: pairs (i1, i2) are halves (neox) or neighbours (GPT-J)."""
    heads = tl.arange(0, HEADS_PAD)
    i = tl.arange(0, HALF_PAD)
    if IS_NEOX:
        i1 = i
        i2 = i + ROT_HALF
    else:
        i1 = 2 * i
        i2 = 2 * i + 1
    head_ok = heads < num_heads
    mask = head_ok[:, None] & (i < ROT_HALF)[None, :]  # [HEADS_PAD, HALF_PAD]
    x_row = x_ptr + tok * stride_xt + heads[:, None] * stride_xh
    o_row = out_ptr + tok * stride_ot + heads[:, None] * stride_oh
    x1 = tl.load(x_row + i1[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_row + i2[None, :], mask=mask, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    tl.store(o_row + i1[None, :], (x1 * cos[None, :] - x2 * sin[None, :]).to(dtype), mask=mask)
    tl.store(o_row + i2[None, :], (x2 * cos[None, :] + x1 * sin[None, :]).to(dtype), mask=mask)
    if PASS_PAD > 0:  # channels past the rotary dims are copied unchanged
        j = 2 * ROT_HALF + tl.arange(0, PASS_PAD)
        pass_mask = head_ok[:, None] & (j < HEAD_DIM)[None, :]
        tl.store(o_row + j[None, :], tl.load(x_row + j[None, :], mask=pass_mask), mask=pass_mask)


@triton.jit
def _rotary_kernel(
    q_out_ptr, k_out_ptr, q_ptr, k_ptr, positions_ptr, cos_sin_ptr, num_heads, num_kv_heads,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_oqt, stride_oqh, stride_okt, stride_okh,
    HEAD_DIM: tl.constexpr, ROT_HALF: tl.constexpr, IS_NEOX: tl.constexpr, Q_HEADS_PAD: tl.constexpr,
    K_HEADS_PAD: tl.constexpr, HALF_PAD: tl.constexpr, PASS_PAD: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + tok).to(tl.int64)
    i = tl.arange(0, HALF_PAD)
    row = cos_sin_ptr + pos * (2 * ROT_HALF)
    dtype = q_out_ptr.dtype.element_ty
    # The torch spec multiplies in the input dtype: round cos/sin to it first.
    cos = tl.load(row + i, mask=i < ROT_HALF, other=0.0).to(dtype).to(tl.float32)  # [HALF_PAD]
    sin = tl.load(row + ROT_HALF + i, mask=i < ROT_HALF, other=0.0).to(dtype).to(tl.float32)
    _rotate_heads(q_out_ptr, q_ptr, cos, sin, tok, num_heads, stride_qt, stride_qh, stride_oqt, stride_oqh,
                  HEAD_DIM, ROT_HALF, IS_NEOX, Q_HEADS_PAD, HALF_PAD, PASS_PAD)
    _rotate_heads(k_out_ptr, k_ptr, cos, sin, tok, num_kv_heads, stride_kt, stride_kh, stride_okt,
                  stride_okh, HEAD_DIM, ROT_HALF, IS_NEOX, K_HEADS_PAD, HALF_PAD, PASS_PAD)


def rotary_embedding(
    positions: torch.Tensor,  # [T] int
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, KVH, D]
    cos_sin_cache: torch.Tensor,  # [max_positions, rot_dim]: cos in the first half, sin in the second
    is_neox: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as ``fused.rotary_embedding``; returns new (rotated) q and k."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    rot_dim = cos_sin_cache.shape[1]
    if rot_dim % 2 or rot_dim > head_dim or q.dtype != k.dtype:
        raise ValueError(f"rotary_embedding: rot_dim {rot_dim} must be even and <= head_dim {head_dim}, "
                         f"and q/k dtypes must match ({q.dtype} vs {k.dtype})")
    q = q if q.stride(-1) == 1 else q.contiguous()
    k = k if k.stride(-1) == 1 else k.contiguous()
    cos_sin_cache = cos_sin_cache.contiguous()
    q_out, k_out = torch.empty(q.shape, dtype=q.dtype, device=q.device), torch.empty(k.shape, dtype=k.dtype,
                                                                                     device=k.device)
    pass_dims = head_dim - rot_dim
    if num_tokens:
        _rotary_kernel[(num_tokens,)](
            q_out, k_out, q, k, positions, cos_sin_cache, num_heads, num_kv_heads,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1),
            q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1),
            HEAD_DIM=head_dim, ROT_HALF=rot_dim // 2, IS_NEOX=is_neox,
            Q_HEADS_PAD=triton.next_power_of_2(num_heads), K_HEADS_PAD=triton.next_power_of_2(num_kv_heads),
            HALF_PAD=triton.next_power_of_2(rot_dim // 2),
            PASS_PAD=triton.next_power_of_2(pass_dims) if pass_dims else 0,
        )
    return q_out, k_out
