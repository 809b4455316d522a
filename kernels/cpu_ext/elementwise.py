"""The fused norm, rotary and SiLU-and-mul ops of the compiled CPU extension (``fused_ops.cpp``).

``kernels/fused.py`` sends CPU tensors here when ``usable`` (``decode.usable``): one call where the
torch code runs 7-25 ops, which at a decode step's one token a sequence cost their dispatch (~150 us a layer)
rather than their arithmetic. Same numerics as the torch code (see the source's header): the
rotary op is bit for bit, the norm differs only in the order its sum of squares is added, SiLU-and-mul
in its exponential's last float32 bits (a vector polynomial where torch calls Sleef).

The library is the decode kernel's (``decode.Build``): one build, one switch,
``BATCHINFER_CPU_DECODE_KERNEL`` (``0``: torch paths only; ``1``: a failed build raises).
"""

from __future__ import annotations

import torch

from batchinfer.kernels.cpu_ext import decode
from batchinfer.kernels.cpu_ext.decode import usable

DTYPES = decode.DTYPES
__all__ = ["rms_norm", "rotary_cache", "rotary_supported", "silu_and_mul", "silu_and_mul_supported", "usable"]
MAX_ROTARY_DIM = 1024  # the op keeps a row of cos | sin on its stack


def rms_norm(
    x: torch.Tensor,  # [T, C], unit last stride
    weight: torch.Tensor,  # [C], x's dtype
    eps: float,
    residual: torch.Tensor | None = None,  # [T, C]
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``kernels.fused.rms_norm`` in one call: ``normed`` or, with ``residual``, ``(normed, x +
    residual)``. Raises ``RuntimeError`` for tensors outside the op's contract."""
    normed, summed = decode.library().rms_norm(x, weight.contiguous(), float(eps), residual)
    return normed if residual is None else (normed, summed)


def rotary_cache(
    positions: torch.Tensor,  # [T] int
    q: torch.Tensor,  # [T, H, D], rotated in place
    k: torch.Tensor,  # [T, KVH, D], rotated in place
    cos_sin: torch.Tensor,  # [max_positions, rot_dim] float32: cos | sin
    is_neox: bool = True,
    v: torch.Tensor | None = None,  # [T, KVH, D]
    k_cache: torch.Tensor | None = None,  # [num_blocks, block_size, KVH, D]
    v_cache: torch.Tensor | None = None,
    slot_mapping: torch.Tensor | None = None,  # [T] int; -1 = skip
) -> None:
    """Rotate q and k in place (``kernels.fused.rotary_embedding``'s result, bit for bit), then,
    with the caches, write k and v to their slots (``kernels.write_kv``). Every position and slot
    is checked before anything is written: ``IndexError`` names the first one out of range."""
    decode.library().rotary_cache(positions.contiguous(), q, k, cos_sin, is_neox, v, k_cache, v_cache,
                                  None if slot_mapping is None else slot_mapping.contiguous())


def rotary_supported(q: torch.Tensor, k: torch.Tensor, cos_sin: torch.Tensor,
                     caches: tuple[torch.Tensor, torch.Tensor] | None = None) -> bool:
    """Whether ``rotary_cache`` takes these tensors (the rest take the torch path): q and k (and
    the caches) of one of ``DTYPES`` with a contiguous last axis, a float32 table of at most
    ``MAX_ROTARY_DIM`` columns."""
    ok = (q.dtype == k.dtype and q.stride(-1) == 1 and k.stride(-1) == 1 and cos_sin.dtype == torch.float32
          and cos_sin.shape[-1] <= MAX_ROTARY_DIM and cos_sin.stride(-1) == 1)
    if ok and caches is not None:
        ok = all(c.dtype == q.dtype and c.stride(-1) == 1 for c in caches)
    return ok and usable(q)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:  # [T, 2I] -> [T, I]
    """``kernels.fused.silu_and_mul`` in one pass: ``silu(gate) * up`` of ``x = [gate | up]``, rounded
    as torch's ``silu(gate).mul_(up)`` rounds. Raises ``RuntimeError`` outside the op's contract."""
    return decode.library().silu_and_mul(x)


def silu_and_mul_supported(x: torch.Tensor) -> bool:
    """Whether ``silu_and_mul`` takes ``x``: a [T, 2I] tensor of one of ``DTYPES`` with a contiguous
    last axis, while the library is ``usable``."""
    return x.dim() == 2 and x.shape[-1] % 2 == 0 and x.stride(-1) == 1 and usable(x)
