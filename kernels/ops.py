"""``torch.library`` custom ops ``batchinfer::paged_attention`` / ``varlen_attention`` / ``write_kv``.

torch.compile sees each op as one opaque node: its fake implementation gives output shapes
without running anything, so graphs never break on the backends' Python (host loops, Triton
launches, flash-attn calls). The public functions route through these ops only while
compiling; eager calls skip the custom-op dispatch cost and run ``dispatch`` directly. CUDA
graphs need nothing extra: the Triton and flash paths never read tensor values on the host.

(No ``from __future__ import annotations`` here: custom_op infers the schema from live annotations.)
"""

import torch

from batchinfer.kernels import dispatch


@torch.library.custom_op("batchinfer::paged_attention", mutates_args=())
def paged_attention_op(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, scale: float | None = None,
    sliding_window: int | None = None, backend: str | None = None, softcap: float | None = None,
    causal: bool = True,
) -> torch.Tensor:
    """Ragged paged attention; see ``batchinfer.kernels.paged_attention``."""
    return dispatch.paged_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens,
                                    scale, sliding_window, backend, softcap, causal)


@paged_attention_op.register_fake
def _paged_attention_fake(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale=None,
                          sliding_window=None, backend=None, softcap=None, causal=True):
    dispatch.check_attention_inputs(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, sliding_window,
                                    softcap)
    return torch.empty_like(q)  # [Tq, H, D]


@torch.library.custom_op("batchinfer::varlen_attention", mutates_args=())
def varlen_attention_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, causal: bool,
    scale: float | None = None, sliding_window: int | None = None, softcap: float | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """Attention of packed sequences over their own keys; see ``batchinfer.kernels.varlen_attention``."""
    return dispatch.varlen_attention(q, k, v, cu_seqlens, causal, scale, sliding_window, softcap, backend)


@varlen_attention_op.register_fake
def _varlen_attention_fake(q, k, v, cu_seqlens, causal, scale=None, sliding_window=None, softcap=None,
                           backend=None):
    dispatch.check_varlen_inputs(q, k, v, cu_seqlens, sliding_window, softcap)
    return torch.empty_like(q)  # [T, H, D]


@torch.library.custom_op("batchinfer::write_kv", mutates_args=("k_cache", "v_cache"))
def write_kv_op(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    slot_mapping: torch.Tensor, backend: str | None = None,
) -> None:
    """Scatter keys/values into the paged cache; see ``batchinfer.kernels.write_kv``."""
    dispatch.write_kv(k, v, k_cache, v_cache, slot_mapping, backend)


@write_kv_op.register_fake
def _write_kv_fake(k, v, k_cache, v_cache, slot_mapping, backend=None):
    dispatch.check_write_kv_inputs(k, v, k_cache, v_cache, slot_mapping)
