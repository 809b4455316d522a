"""Eager entry points: check the inputs' shapes, pick the backend (attention's table), run it.

Checks read shapes, dtypes and devices only — never tensor values — so they cost no host
sync and are safe during CUDA-graph capture. (The reference and cpu backends do read values.)

Selection (``registry.Family``): ``backend=None`` is the best backend available for the tensors'
device and shapes — ``flash > triton > reference`` on CUDA, ``cpu`` on CPU (``reference`` for a
non-floating-point cache; ``reference`` stays available by name: it is the specification); an
explicit name is that backend, or a ``ValueError`` (unknown) / ``RuntimeError`` (unavailable here,
and why).
"""

from __future__ import annotations

import functools

import torch

from batchinfer.kernels import cpu_attention, reference, registry

PREFERENCE = {  # per device type, best first; other devices get "reference" only
    "cuda": ("flash", "triton", "reference"),
    "cpu": ("cpu", "triton", "reference"),  # triton only under the interpreter, and only by name
}
ATTENTION = registry.Family("attention", (registry.FLASH, registry.TRITON, registry.REFERENCE, registry.CPU),
                            PREFERENCE, fallback=("reference",))
BACKENDS = ATTENTION.names  # ("flash", "triton", "reference", "cpu")

unavailable_reason = ATTENTION.unavailable_reason
available_backends = ATTENTION.available_backends
select_backend = ATTENTION.select_backend


def check_attention_inputs(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, sliding_window: int | None,
    softcap: float | None = None,
) -> None:
    """Raise ``ValueError`` naming the first argument that breaks the contract."""
    if q.dim() != 3:
        raise ValueError(f"paged_attention: q must be [num_q_tokens, num_heads, head_dim], "
                         f"got shape {tuple(q.shape)}")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError("paged_attention: k_cache and v_cache must both be [num_blocks, block_size, "
                         f"num_kv_heads, head_dim], got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    if k_cache.shape[3] != head_dim:
        raise ValueError(f"paged_attention: q head_dim {head_dim} != cache head_dim {k_cache.shape[3]}")
    if num_kv_heads == 0 or num_heads % num_kv_heads:
        raise ValueError(f"paged_attention: num_heads {num_heads} must be a multiple of "
                         f"num_kv_heads {num_kv_heads}")
    if seq_lens.dim() != 1 or block_tables.dim() != 2 or block_tables.shape[0] != seq_lens.shape[0]:
        raise ValueError(f"paged_attention: block_tables {tuple(block_tables.shape)} must be "
                         f"[num_seqs, max_blocks] with num_seqs = len(seq_lens) and seq_lens 1-D, "
                         f"got seq_lens {tuple(seq_lens.shape)}")
    if cu_seqlens_q.shape != (seq_lens.shape[0] + 1,):
        raise ValueError(f"paged_attention: cu_seqlens_q must have num_seqs + 1 = {seq_lens.shape[0] + 1} "
                         f"entries, got shape {tuple(cu_seqlens_q.shape)}")
    for name, t in (("block_tables", block_tables), ("cu_seqlens_q", cu_seqlens_q), ("seq_lens", seq_lens)):
        if t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"paged_attention: {name} must be int32 (or int64), got {t.dtype}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache), ("block_tables", block_tables),
                    ("cu_seqlens_q", cu_seqlens_q), ("seq_lens", seq_lens)):
        if t.device != q.device:
            raise ValueError(f"paged_attention: {name} is on {t.device} but q is on {q.device}")
    _check_window_and_softcap("paged_attention", sliding_window, softcap)


def check_write_kv_inputs(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Raise ``ValueError`` naming the first argument that breaks the contract."""
    if k.dim() != 3 or k.shape != v.shape:
        raise ValueError(f"write_kv: k and v must both be [num_tokens, num_kv_heads, head_dim], "
                         f"got {tuple(k.shape)} and {tuple(v.shape)}")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape or k_cache.shape[2:] != k.shape[1:]:
        raise ValueError(f"write_kv: caches {tuple(k_cache.shape)} / {tuple(v_cache.shape)} must be "
                         f"[num_blocks, block_size, {k.shape[1]}, {k.shape[2]}] to match k")
    if slot_mapping.shape != (k.shape[0],) or slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"write_kv: slot_mapping must be int32/int64 of shape ({k.shape[0]},), got "
                         f"{slot_mapping.dtype} {tuple(slot_mapping.shape)}")
    for name, t in (("v", v), ("k_cache", k_cache), ("v_cache", v_cache), ("slot_mapping", slot_mapping)):
        if t.device != k.device:
            raise ValueError(f"write_kv: {name} is on {t.device} but k is on {k.device}")


@functools.lru_cache(maxsize=256)
def _select(backend: str | None, device: torch.device, dtype: torch.dtype, block_size: int,
            head_dim: int) -> str:
    return select_backend(backend, device, dtype, block_size, head_dim)


def paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, scale: float | None = None,
    sliding_window: int | None = None, backend: str | None = None, softcap: float | None = None,
    causal: bool = True,
) -> torch.Tensor:  # [Tq, H, D]
    """Check, select, run (see ``batchinfer.kernels.paged_attention``)."""
    check_attention_inputs(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, sliding_window, softcap)
    name = _select(backend, q.device, k_cache.dtype, k_cache.shape[1], q.shape[2])
    if name == "flash" and softcap is not None:
        name = _flash_or_fallback(backend, q.device, k_cache.dtype)
    args = (q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale, sliding_window)
    if name == "reference":
        return reference.paged_attention(*args, softcap=softcap, causal=causal)
    if q.dtype != k_cache.dtype or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"paged_attention[{name}]: q, k_cache and v_cache must share a dtype, "
                         f"got {q.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    if name == "cpu":
        return cpu_attention.paged_attention(*args, softcap=softcap, causal=causal)
    if name == "triton":
        from batchinfer.kernels import triton_attention

        return triton_attention.paged_attention(*args, softcap=softcap, causal=causal)
    from batchinfer.kernels import flash

    return flash.paged_attention(*args, softcap=softcap, causal=causal)


def _flash_or_fallback(backend: str | None, device: torch.device, dtype: torch.dtype) -> str:
    """``flash`` when its provider takes ``softcap``; else the next automatic choice, or a clear
    ``RuntimeError`` when flash was asked for by name."""
    from batchinfer.kernels import flash

    if flash.supports_softcap():
        return "flash"
    if backend == "flash":
        raise RuntimeError("attention backend 'flash' is unavailable: its flash_attn_varlen_func "
                           "takes no softcap argument (needed by this model's soft-capped attention)")
    triton_ok = unavailable_reason("triton", device, dtype) is None
    return "triton" if triton_ok else "reference"


def check_varlen_inputs(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
    sliding_window: int | None, softcap: float | None,
) -> None:
    """Raise ``ValueError`` naming the first argument of ``varlen_attention`` that breaks its
    contract (shapes, dtypes, devices only)."""
    if q.dim() != 3:
        raise ValueError(f"varlen_attention: q must be [num_tokens, num_heads, head_dim], got shape "
                         f"{tuple(q.shape)}")
    if k.dim() != 3 or k.shape != v.shape or k.shape[0] != q.shape[0] or k.shape[2] != q.shape[2]:
        raise ValueError(f"varlen_attention: k and v must both be [num_tokens={q.shape[0]}, num_kv_heads, "
                         f"head_dim={q.shape[2]}], got {tuple(k.shape)} and {tuple(v.shape)}")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise ValueError(f"varlen_attention: num_heads {q.shape[1]} must be a multiple of num_kv_heads "
                         f"{k.shape[1]}")
    if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 1 or cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"varlen_attention: cu_seqlens must be a 1-D int32 (or int64) tensor of "
                         f"num_seqs + 1 offsets, got {cu_seqlens.dtype} {tuple(cu_seqlens.shape)}")
    if q.dtype != k.dtype or v.dtype != k.dtype:
        raise ValueError(f"varlen_attention: q, k and v must share a dtype, got {q.dtype}, {k.dtype}, "
                         f"{v.dtype}")
    for name, t in (("k", k), ("v", v), ("cu_seqlens", cu_seqlens)):
        if t.device != q.device:
            raise ValueError(f"varlen_attention: {name} is on {t.device} but q is on {q.device}")
    _check_window_and_softcap("varlen_attention", sliding_window, softcap)


def _check_window_and_softcap(op: str, sliding_window: int | None, softcap: float | None) -> None:
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"{op}: sliding_window must be >= 1 or None, got {sliding_window}")
    if softcap is not None and not softcap > 0:  # also refuses NaN
        raise ValueError(f"{op}: softcap must be > 0 or None, got {softcap}")


def _check_offsets(cu: list[int], num_tokens: int) -> None:
    """The value check of ``cu_seqlens`` (on its host copy): 0 = cu[0] <= cu[1] <= ... = num_tokens."""
    if cu[0] != 0 or cu[-1] != num_tokens:
        raise ValueError(f"varlen_attention: cu_seqlens must run from 0 to num_tokens={num_tokens}, "
                         f"got {cu[0]}..{cu[-1]}")
    for i in range(len(cu) - 1):
        if cu[i + 1] < cu[i]:
            raise ValueError(f"varlen_attention: cu_seqlens must not decrease, got cu_seqlens[{i}:{i + 2}] = "
                             f"{cu[i:i + 2]}")


def varlen_as_paged(
    k: torch.Tensor,  # [T, KVH, D]
    v: torch.Tensor,  # [T, KVH, D]
    cu_seqlens: torch.Tensor,  # [S + 1] int
    max_len: int,  # >= every sequence's length
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Packed k/v as a paged cache without a copy: one-token blocks, so token t is block t and
    sequence i's block table is ``cu_seqlens[i], cu_seqlens[i] + 1, ...`` (no sequence needs to
    start on a block boundary). Returns ``(k_cache, v_cache, block_tables, seq_lens)``:
    ``[T, 1, KVH, D]`` views, ``[S, max_len]`` int32 (columns past a sequence clamped in range),
    ``[S]`` int32."""
    starts = cu_seqlens[:-1].to(torch.int32)
    seq_lens = (cu_seqlens[1:] - cu_seqlens[:-1]).to(torch.int32)
    cols = torch.arange(max_len, dtype=torch.int32, device=k.device)
    tables = (starts[:, None] + cols[None, :]).clamp_(max=max(k.shape[0] - 1, 0))  # [S, max_len]
    return k.unsqueeze(1), v.unsqueeze(1), tables, seq_lens


def varlen_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, causal: bool,
    scale: float | None = None, sliding_window: int | None = None, softcap: float | None = None,
    backend: str | None = None,
) -> torch.Tensor:  # [T, H, D]
    """Check, select, run (see ``batchinfer.kernels.varlen_attention``): ``paged_attention`` over
    the one-token-block view of ``varlen_as_paged``. flash (blocks: multiples of 16) cannot take
    that layout: chosen automatically, Triton serves instead; named, it raises ``RuntimeError``."""
    check_varlen_inputs(q, k, v, cu_seqlens, sliding_window, softcap)
    try:
        name = _select(backend, q.device, k.dtype, 1, q.shape[2])
    except RuntimeError as exc:
        raise RuntimeError(f"varlen_attention lays k/v out as one-token blocks: {exc}") from None
    num_tokens = q.shape[0]
    if q.is_cuda and torch.cuda.is_current_stream_capturing():
        max_len = num_tokens  # reading lengths would sync; any bound >= the longest works
    else:
        cu = cu_seqlens.tolist()  # CPU: a ~2 us copy; CUDA: one sync per call
        _check_offsets(cu, num_tokens)
        max_len = max((b - a for a, b in zip(cu[:-1], cu[1:], strict=True)), default=0)
    if num_tokens == 0:
        return torch.empty_like(q)
    k_cache, v_cache, tables, seq_lens = varlen_as_paged(k, v, cu_seqlens, max_len)
    return paged_attention(q, k_cache, v_cache, tables, cu_seqlens, seq_lens, scale, sliding_window, name,
                           softcap, causal)


def write_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    slot_mapping: torch.Tensor, backend: str | None = None,
) -> None:
    """Check, select, run (see ``batchinfer.kernels.write_kv``).

    flash-attn has no cache-write op, so ``flash`` writes with the Triton kernel when Triton is
    available (it is wherever flash is, in practice) and with the reference otherwise; ``cpu``
    writes with the reference (one indexed copy, already fast on CPU).
    """
    check_write_kv_inputs(k, v, k_cache, v_cache, slot_mapping)
    name = _select(backend, k.device, k_cache.dtype, k_cache.shape[1], k.shape[2])
    if name == "flash":
        triton_ok = unavailable_reason("triton", k.device, k_cache.dtype) is None
        name = "triton" if triton_ok else "reference"
    if name == "triton":
        from batchinfer.kernels import triton_cache

        triton_cache.write_kv(k, v, k_cache, v_cache, slot_mapping)
    else:
        reference.write_kv(k, v, k_cache, v_cache, slot_mapping)
