"""GGUF tensor bytes -> torch tensors: vectorised dequantizers for ggml's block layouts.

Each quantized type stores blocks of ``block_size`` values in ``type_size`` bytes (``gguf``'s
``GGML_QUANT_SIZES``). Every dequantizer here takes the blocks as a ``(n_blocks, type_size)``
uint8 tensor and returns ``(n_blocks, block_size)`` float32, with whole-tensor torch ops (no
per-block Python), on whatever device the bytes are on: the worker's GPU when it has one. The
layouts follow ggml-quants.c, and ``gguf.quants``' numpy dequantizers, which the tests compare
against, line by line.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, ReaderTensor

Q = GGMLQuantizationType
_U8 = torch.uint8


def _f16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The fp16 field at byte ``start`` of every block, as ``(n_blocks, 1)`` float32."""
    return blocks[:, start:start + 2].contiguous().view(torch.float16).float()


def _shifted(x: torch.Tensor, shifts: Sequence[int], mask: int) -> torch.Tensor:
    """``(x[..., None, :] >> shift) & mask`` for each shift: ``(..., k)`` -> ``(..., len(shifts), k)``."""
    s = torch.tensor(shifts, dtype=_U8, device=x.device).view(-1, 1)
    return (x.unsqueeze(-2) >> s) & mask


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """Low nibbles then high nibbles of each block's bytes: ``(n, k)`` -> ``(n, 2k)``."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def _bits32(qh: torch.Tensor) -> torch.Tensor:
    """The 32 bits of a little-endian uint32 stored as 4 bytes: ``(n, 4)`` -> ``(n, 32)`` of 0/1."""
    return _shifted(qh, range(8), 1).transpose(-1, -2).reshape(qh.shape[0], 32)


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    return _f16(b, 0) * (_nibbles(b[:, 2:]).float() - 8)


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    return _f16(b, 0) * _nibbles(b[:, 4:]).float() + _f16(b, 2)


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    q = _nibbles(b[:, 6:]) | (_bits32(b[:, 2:6]) << 4)
    return _f16(b, 0) * (q.float() - 16)


def _q5_1(b: torch.Tensor) -> torch.Tensor:
    q = _nibbles(b[:, 8:]) | (_bits32(b[:, 4:8]) << 4)
    return _f16(b, 0) * q.float() + _f16(b, 2)


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    return _f16(b, 0) * b[:, 2:].view(torch.int8).float()


def _q8_k(b: torch.Tensor) -> torch.Tensor:
    d = b[:, :4].contiguous().view(torch.float32)
    return d * b[:, 4:260].view(torch.int8).float()


def _q2_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    scales, qs = b[:, :16], b[:, 16:80]
    dl = (_f16(b, 80) * (scales & 0x0F).float()).view(n, 16, 1)
    ml = (_f16(b, 82) * (scales >> 4).float()).view(n, 16, 1)
    q = _shifted(qs.reshape(n, 2, 32), (0, 2, 4, 6), 3).reshape(n, 16, 16).float()
    return (dl * q - ml).reshape(n, 256)


def _q3_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    hmask, qs, scales = b[:, :32], b[:, 32:96], b[:, 96:108]
    # 16 six-bit scales: low 4 bits in bytes 0-7 (two per byte), high 2 bits in bytes 8-11.
    low = _shifted(scales[:, :8], (0, 4), 0x0F).reshape(n, 16)
    high = _shifted(scales[:, 8:12], (0, 2, 4, 6), 0x03).reshape(n, 16)
    sc = (low | (high << 4)).float() - 32
    dl = (_f16(b, 108) * sc).view(n, 16, 1)
    ql = _shifted(qs.reshape(n, 2, 32), (0, 2, 4, 6), 3).reshape(n, 16, 16)
    qh = _shifted(hmask.reshape(n, 1, 32), range(8), 1).reshape(n, 16, 16) ^ 1  # set bit = no offset
    q = ql.float() - (qh << 2).float()
    return (dl * q).reshape(n, 256)


def _k_scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K: eight 6-bit scales and eight 6-bit mins packed in 12 bytes."""
    d, m, md = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc.float(), mn.float()


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    sc, mn = _k_scale_min(b[:, 4:16])
    d = (_f16(b, 0) * sc).view(n, 8, 1)
    dm = (_f16(b, 2) * mn).view(n, 8, 1)
    q = _shifted(b[:, 16:144].reshape(n, 4, 32), (0, 4), 0x0F).reshape(n, 8, 32).float()
    return (d * q - dm).reshape(n, 256)


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    sc, mn = _k_scale_min(b[:, 4:16])
    d = (_f16(b, 0) * sc).view(n, 8, 1)
    dm = (_f16(b, 2) * mn).view(n, 8, 1)
    ql = _shifted(b[:, 48:176].reshape(n, 4, 32), (0, 4), 0x0F).reshape(n, 8, 32)
    qh = _shifted(b[:, 16:48].reshape(n, 1, 32), range(8), 1).reshape(n, 8, 32)
    q = (ql | (qh << 4)).float()
    return (d * q - dm).reshape(n, 256)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    ql, qh, scales = b[:, :128], b[:, 128:192], b[:, 192:208]
    d = (_f16(b, 208) * scales.view(torch.int8).float()).view(n, 16, 1)
    low = _shifted(ql.reshape(n, 2, 64), (0, 4), 0x0F).reshape(n, 8, 32)
    high = _shifted(qh.reshape(n, 2, 32), (0, 2, 4, 6), 3).reshape(n, 8, 32)
    q = (low | (high << 4)).float().reshape(n, 16, 16) - 32
    return (d * q).reshape(n, 256)


_BLOCKS: dict[Q, Callable[[torch.Tensor], torch.Tensor]] = {
    Q.Q4_0: _q4_0, Q.Q4_1: _q4_1, Q.Q5_0: _q5_0, Q.Q5_1: _q5_1, Q.Q8_0: _q8_0, Q.Q8_K: _q8_k,
    Q.Q2_K: _q2_k, Q.Q3_K: _q3_k, Q.Q4_K: _q4_k, Q.Q5_K: _q5_k, Q.Q6_K: _q6_k,
}
_PLAIN = {Q.F32: torch.float32, Q.F16: torch.float16, Q.BF16: torch.bfloat16}
_CPU_CHUNK = 1 << 19  # values per dequantization step on a CPU
SUPPORTED_TYPES: tuple[str, ...] = tuple(t.name for t in (*_PLAIN, *_BLOCKS))


def dequantize_bytes(
    data: np.ndarray | torch.Tensor,
    qtype: int | GGMLQuantizationType,
    shape: Sequence[int],
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    name: str = "tensor",
) -> torch.Tensor:
    """Dequantize one tensor's raw data (its bytes, or its F32/F16 values) to ``shape`` in ``dtype``.

    ``shape`` is in torch order (rows first: the reverse of ggml's ``ne``). The bytes move to
    ``device`` before they are unpacked, so a GPU does the arithmetic. ``ValueError`` names the
    tensor and its type when the type has no dequantizer here or the byte count does not fit.
    """
    try:
        qtype = Q(int(qtype))
    except ValueError:
        raise ValueError(f"{name}: unknown GGUF tensor type {qtype}; supported: "
                         f"{', '.join(SUPPORTED_TYPES)}") from None
    if qtype not in _PLAIN and qtype not in _BLOCKS:
        raise ValueError(f"{name}: GGUF tensor type {qtype.name} is not supported; supported: "
                         f"{', '.join(SUPPORTED_TYPES)}")
    raw = torch.from_numpy(np.ascontiguousarray(data)) if isinstance(data, np.ndarray) else data
    raw = raw.to(device).reshape(-1)
    numel = int(np.prod(shape)) if len(shape) else 1
    if qtype in _PLAIN:
        values = raw if raw.dtype == _PLAIN[qtype] else raw.view(_U8).view(_PLAIN[qtype])
        if values.numel() != numel:
            raise ValueError(f"{name}: {values.numel()} {qtype.name} values for shape {tuple(shape)}")
        return values.reshape(tuple(shape)).to(dtype)
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    raw = raw.view(_U8)
    if numel % block_size or raw.numel() != numel // block_size * type_size:
        raise ValueError(f"{name}: {raw.numel()} bytes of {qtype.name} do not hold shape {tuple(shape)} "
                         f"({block_size} values per {type_size}-byte block)")
    blocks = raw.view(-1, type_size)
    out = torch.empty((blocks.shape[0], block_size), dtype=dtype, device=raw.device)
    # On a CPU, slices of ~half a million values keep each step's temporaries in cache: twice the
    # throughput of one pass over a large tensor. A GPU takes the tensor whole.
    step = blocks.shape[0] if raw.device.type != "cpu" else max(1, _CPU_CHUNK // block_size)
    for start in range(0, blocks.shape[0], step):
        out[start:start + step] = _BLOCKS[qtype](blocks[start:start + step])
    return out.reshape(tuple(shape))


def dequantize(
    tensor: ReaderTensor, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> torch.Tensor:
    """A ``gguf`` reader tensor as a torch tensor of its logical shape (rows first), dequantized."""
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    return dequantize_bytes(tensor.data, tensor.tensor_type, shape, dtype, device, name=tensor.name)
