"""``write_kv`` as a Triton kernel: one program per new token scatters its keys and values
(all KV heads) into the token's cache slot; slot -1 is skipped without touching memory."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, num_kv_heads,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
    HEAD_DIM: tl.constexpr, HEADS_PAD: tl.constexpr, DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    if slot < 0:
        return  # padding token: nothing to cache
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, DIM_PAD)
    mask = (heads < num_kv_heads)[:, None] & (dims < HEAD_DIM)[None, :]  # [HEADS_PAD, DIM_PAD]
    k = tl.load(k_ptr + tok * stride_kt + heads[:, None] * stride_kh + dims[None, :], mask=mask)
    v = tl.load(v_ptr + tok * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=mask)
    kc = k_cache_ptr + block * stride_kcb + offset * stride_kcs + heads[:, None] * stride_kch + dims[None, :]
    vc = v_cache_ptr + block * stride_vcb + offset * stride_vcs + heads[:, None] * stride_vch + dims[None, :]
    tl.store(kc, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(vc, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv(
    k: torch.Tensor,  # [T, KVH, D]
    v: torch.Tensor,  # [T, KVH, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
    slot_mapping: torch.Tensor,  # [T] int; -1 = skip
) -> None:
    """Scatter each token's key and value into its cache slot (block * block_size + offset)."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    if any(t.stride(-1) != 1 for t in (k, v, k_cache, v_cache)):
        raise ValueError("triton write_kv needs k, v and the caches contiguous in head_dim")
    _write_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping, num_kv_heads,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        HEAD_DIM=head_dim, HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        DIM_PAD=triton.next_power_of_2(head_dim), BLOCK_SIZE=k_cache.shape[1],
    )
