"""The ``flash`` backend: ``flash_attn_varlen_func`` with a ``block_table`` over our paged cache.

Our cache layout ``[num_blocks, block_size, num_kv_heads, head_dim]`` is flash-attn's paged
layout, so no copies are made. Two providers are probed, best first:

- ``vllm_flash_attn`` (vLLM's fork; paged blocks of any multiple of 16). Its last PyPI release
  pins torch 2.4, so it is never a hard dependency of batchinfer;
- ``flash_attn`` (upstream; paged blocks must be a multiple of 256, so it only serves caches
  built with such blocks).

Two API generations are handled: the newer one takes per-sequence key lengths as ``seqused_k``,
the older one takes cumulative ``cu_seqlens_k``. Soft-capping goes as ``softcap`` (flash-attn
>= 2.6 and vllm-flash-attn: ``softcap * tanh(scores / softcap)``, 0 = off); a provider without
that argument never gets a soft-capped call (``dispatch`` falls back to Triton, or refuses).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
from collections.abc import Callable
from dataclasses import dataclass

import torch

PROVIDERS = (("vllm_flash_attn", 16), ("flash_attn", 256))  # (module, block size granularity)


@dataclass(frozen=True)
class FlashProvider:
    module: str
    block_multiple: int
    func: Callable
    takes_seqused_k: bool
    takes_softcap: bool = False


@functools.cache
def _probe() -> FlashProvider | str:
    """The first importable provider, or a reason string listing what was tried."""
    tried = []
    for module, multiple in PROVIDERS:
        if importlib.util.find_spec(module) is None:
            tried.append(f"{module} is not installed")
            continue
        try:
            func = importlib.import_module(module).flash_attn_varlen_func
        except Exception as exc:  # e.g. built against another torch: report, never crash import
            tried.append(f"{module} failed to import: {exc}")
            continue
        params = inspect.signature(func).parameters
        if "block_table" not in params:
            tried.append(f"{module}.flash_attn_varlen_func has no block_table (too old)")
            continue
        return FlashProvider(module, multiple, func, "seqused_k" in params, "softcap" in params)
    return "; ".join(tried)


def unavailable_reason(
    device: torch.device,
    dtype: torch.dtype | None = None,
    block_size: int | None = None,
    head_dim: int | None = None,
) -> str | None:
    """Why the flash backend cannot serve these tensors, or None when it can."""
    if device.type != "cuda":
        return f"needs CUDA tensors (got {device.type})"
    provider = _probe()
    if isinstance(provider, str):
        return provider
    if dtype is not None and dtype not in (torch.float16, torch.bfloat16):
        return f"{provider.module} supports float16/bfloat16, not {dtype}"
    if block_size is not None and block_size % provider.block_multiple:
        return f"{provider.module} needs a block size that is a multiple of {provider.block_multiple}, " \
               f"not {block_size}"
    if head_dim is not None and (head_dim % 8 or head_dim > 256):
        return f"{provider.module} needs a head dim that is a multiple of 8 and at most 256, not {head_dim}"
    return None


def supports_softcap() -> bool:
    """Whether the importable provider takes ``softcap`` (False when there is none)."""
    provider = _probe()
    return not isinstance(provider, str) and provider.takes_softcap


def window_size(sliding_window: int | None, causal: bool = True) -> tuple[int, int]:
    """Our window (a query at p sees p - W < k <= p; |p - k| < W when not causal) as flash-attn's
    inclusive (left, right)."""
    if sliding_window is None:
        return (-1, -1)
    return (sliding_window - 1, 0 if causal else sliding_window - 1)


def paged_attention(
    q: torch.Tensor,  # [Tq, H, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
    block_tables: torch.Tensor,  # [S, max_blocks] int32
    cu_seqlens_q: torch.Tensor,  # [S + 1] int32
    seq_lens: torch.Tensor,  # [S] int32
    scale: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    causal: bool = True,
) -> torch.Tensor:  # [Tq, H, D]
    """The contract's paged attention through ``flash_attn_varlen_func`` (its mask is aligned
    bottom-right, as ours: queries are their sequence's last tokens, causal or not)."""
    provider = _probe()
    if isinstance(provider, str):
        raise RuntimeError(f"attention backend 'flash' is unavailable: {provider}")
    if softcap is not None and not provider.takes_softcap:
        raise RuntimeError(f"attention backend 'flash' is unavailable: {provider.module}."
                           "flash_attn_varlen_func takes no softcap argument")
    # flash-attn sizes its grid from max_seqlen_q. Reading it costs a host sync, which CUDA-graph
    # capture forbids, so during capture the bound Tq (always >= the true maximum) is used.
    if q.is_cuda and torch.cuda.is_current_stream_capturing():
        max_seqlen_q = q.shape[0]
    else:
        max_seqlen_q = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max().item()) if q.shape[0] else 0
    max_seqlen_k = block_tables.shape[1] * k_cache.shape[1]  # an upper bound is all it needs
    kwargs = dict(
        max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, cu_seqlens_q=cu_seqlens_q,
        softmax_scale=scale, causal=causal, window_size=window_size(sliding_window, causal),
        block_table=block_tables,
    )
    if softcap is not None:
        kwargs["softcap"] = softcap
    if provider.takes_seqused_k:
        kwargs["seqused_k"] = seq_lens
    else:
        kwargs["cu_seqlens_k"] = torch.nn.functional.pad(torch.cumsum(seq_lens, 0, dtype=torch.int32), (1, 0))
    return provider.func(q, k_cache, v_cache, **kwargs)
