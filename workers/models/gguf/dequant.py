"""GGUF tensor bytes -> torch tensors: vectorised dequantizers for ggml's block layouts.

Each quantized type stores blocks of ``block_size`` values in ``type_size`` bytes (``gguf``'s
``GGML_QUANT_SIZES``). Every dequantizer here takes a slice of blocks as a ``(n, type_size)``
uint8 tensor and writes its ``(n, block_size)`` float32 values into ``out``, with whole-slice
torch ops (no per-block Python), on whatever device the bytes are on: the worker's GPU when it
has one. The layouts follow ggml-quants.c, and ``gguf.quants``' numpy dequantizers, which the
tests compare against value for value: the same float32 operations in the same order.

What makes it fast on a CPU (docs/benchmarks.md, GGUF dequantization): bit fields are shifted
and masked over whole contiguous runs of bytes and stacked into one contiguous uint8 tensor, so
the one uint8 -> float32 conversion (written straight into the output) and the in-place scale
and offset ops all run on torch's vectorised contiguous path; the tensor goes through in slices
of a million values, so temporaries are reused rather than faulted in afresh; and a large
output is advised onto transparent huge pages, because faulting a fresh output in 4 KiB at a
time costs about as much as the arithmetic.
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Callable, Sequence

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, ReaderTensor

Q = GGMLQuantizationType
_U8 = torch.uint8


def _packed(x: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of ``x`` at offset 0: viewing bytes as wider words needs aligned strides.

    (``.contiguous()`` would hand back a one-block slice as it is, at its odd offset.)
    """
    return x.clone(memory_format=torch.contiguous_format)


def _f16(b: torch.Tensor, start: int, count: int = 1) -> torch.Tensor:
    """The ``count`` fp16 fields from byte ``start`` of every block, as ``(n, count)`` float32.

    Adjacent fields (d and m) come out of one small copy of their bytes.
    """
    return _packed(b[:, start:start + 2 * count]).view(torch.float16).float()


def _fields(b: torch.Tensor, start: int, end: int, shifts: Sequence[int], mask: int,
            groups: int = 1) -> torch.Tensor:
    """Bit fields of bytes ``start:end`` of each block: ``(n, type_size)`` -> ``(n, groups, s, k)`` uint8.

    ``[..., i, :]`` is ``(byte >> shifts[i]) & mask`` for each of the ``groups`` runs of ``k``
    bytes (ggml's order: a run's low fields, then its next fields). The region is copied out
    contiguous once; each shift and mask then runs over it as int64 words (8 bytes an element,
    the mask repeated in every byte), and ``torch.stack`` gathers the results, all contiguous,
    into one contiguous tensor. Nothing strided reaches the uint8 -> float32 cast that follows:
    that is ~20x slower than casting a contiguous tensor.
    """
    n = b.shape[0]
    region = _packed(b[:, start:end])  # (n, end - start)
    if (end - start) % 8 == 0:
        region, mask = region.view(torch.int64), mask * 0x0101010101010101
    parts = [(region >> s if s else region) & mask for s in shifts]
    stacked = torch.stack([p.view(n, groups, -1) for p in parts], dim=2)  # (n, groups, s, words)
    return stacked.view(_U8).view(n, groups, len(shifts), -1)


def _nibbles(b: torch.Tensor, start: int, end: int | None = None, groups: int = 1) -> torch.Tensor:
    """4-bit values of bytes ``start:end``: ``(n, type_size)`` -> ``(n, groups, 2, k)``, low then high."""
    return _fields(b, start, b.shape[1] if end is None else end, (0, 4), 0x0F, groups)


def _fifth_bits(b: torch.Tensor, start: int) -> torch.Tensor:
    """Q5_0 / Q5_1: bit i of the little-endian uint32 at byte ``start``, moved to 16: ``(n, 32)`` uint8."""
    qh = _packed(b[:, start:start + 4]).view(torch.int32)  # (n, 1)
    shifts = torch.arange(32, dtype=torch.int32, device=b.device)
    return torch.bitwise_right_shift(qh, shifts).bitwise_and_(1).to(_U8).bitwise_left_shift_(4)


# --- the 32-value blocks: out = d * q (+ m) ---------------------------------------------------

def _q4_0(b: torch.Tensor, out: torch.Tensor) -> None:
    # (n, 18): fp16 d, 16 bytes of nibbles -> (n, 1, 2, 16) = (n, 32) codes 0..15
    out.copy_(_nibbles(b, 2).view(-1, 32)).sub_(8).mul_(_f16(b, 0))


def _q4_1(b: torch.Tensor, out: torch.Tensor) -> None:
    dm = _f16(b, 0, 2)  # (n, 20): fp16 d, fp16 m, 16 bytes of nibbles; dm is (n, 2)
    out.copy_(_nibbles(b, 4).view(-1, 32)).mul_(dm[:, :1]).add_(dm[:, 1:])


def _q5_0(b: torch.Tensor, out: torch.Tensor) -> None:
    q = _nibbles(b, 6).view(-1, 32).bitwise_or_(_fifth_bits(b, 2))  # (n, 22): d, qh, qs -> 0..31
    out.copy_(q).sub_(16).mul_(_f16(b, 0))


def _q5_1(b: torch.Tensor, out: torch.Tensor) -> None:
    dm = _f16(b, 0, 2)  # (n, 2): d, m
    q = _nibbles(b, 8).view(-1, 32).bitwise_or_(_fifth_bits(b, 4))  # (n, 24): d, m, qh, qs
    out.copy_(q).mul_(dm[:, :1]).add_(dm[:, 1:])


def _q8_0(b: torch.Tensor, out: torch.Tensor) -> None:
    # (n, 34): fp16 d, 32 int8 codes
    out.copy_(b[:, 2:].contiguous().view(torch.int8)).mul_(_f16(b, 0))


def _q8_k(b: torch.Tensor, out: torch.Tensor) -> None:
    # (n, 292): fp32 d, 256 int8 codes, 16 int16 sums (unused here)
    out.copy_(b[:, 4:260].contiguous().view(torch.int8)).mul_(_packed(b[:, :4]).view(torch.float32))


# --- the 256-value K-quant super-blocks: 16 or 8 sub-blocks, each with its own scale ----------

def _q2_k(b: torch.Tensor, out: torch.Tensor) -> None:
    n = b.shape[0]
    scales = b[:, :16]
    dmin = _f16(b, 80, 2)  # (n, 2): d, dmin
    dl = (dmin[:, :1] * (scales & 0x0F).float()).view(n, 16, 1)
    ml = (dmin[:, 1:] * (scales >> 4).float()).view(n, 16, 1)
    q = _fields(b, 16, 80, (0, 2, 4, 6), 3, groups=2)  # (n, 2, 4, 32) = 16 x 16
    out.copy_(q.view(n, 256)).view(n, 16, 16).mul_(dl).sub_(ml)


def _q3_k(b: torch.Tensor, out: torch.Tensor) -> None:
    n = b.shape[0]
    # 16 six-bit scales: low 4 bits in bytes 96-103 (two per byte), high 2 bits in 104-107.
    low = _nibbles(b, 96, 104).view(n, 16)
    high = _fields(b, 104, 108, (0, 2, 4, 6), 3).view(n, 16)
    dl = (_f16(b, 108) * ((low | (high << 4)).float() - 32)).view(n, 16, 1)
    ql = _fields(b, 32, 96, (0, 2, 4, 6), 3, groups=2).view(n, 256)  # 2 x 4 x 32
    qh = _fields(b, 0, 32, range(8), 1).view(n, 256)  # bit j of hmask byte c -> value 32 j + c
    q = ql.sub_(qh.bitwise_xor_(1).bitwise_left_shift_(2))  # a set bit = no -4; wraps to -4..3
    out.copy_(q.view(torch.int8)).view(n, 16, 16).mul_(dl)


def _k_scale_min(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K: eight 6-bit scales and eight 6-bit mins packed in bytes 4-15, as float32."""
    d, m, md = b[:, 4:8], b[:, 8:12], b[:, 12:16]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc.float(), mn.float()


def _k_super_scales(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K: each of the 8 sub-blocks' scale and min, times the super-block's d and dmin:
    (n, 8, 1) each."""
    n = b.shape[0]
    sc, mn = _k_scale_min(b)
    dmin = _f16(b, 0, 2)  # (n, 2): d, dmin
    return (dmin[:, :1] * sc).view(n, 8, 1), (dmin[:, 1:] * mn).view(n, 8, 1)


def _q4_k(b: torch.Tensor, out: torch.Tensor) -> None:
    n = b.shape[0]
    d, dm = _k_super_scales(b)
    q = _nibbles(b, 16, groups=4)  # (n, 4, 2, 32) = 8 sub-blocks of 32
    out.copy_(q.view(n, 256)).view(n, 8, 32).mul_(d).sub_(dm)


def _q5_k(b: torch.Tensor, out: torch.Tensor) -> None:
    n = b.shape[0]
    d, dm = _k_super_scales(b)
    ql = _nibbles(b, 48, groups=4).view(n, 8, 32)
    qh = _fields(b, 16, 48, range(8), 1).view(n, 8, 32)  # bit j of byte c -> value 32 j + c
    q = ql.bitwise_or_(qh.bitwise_left_shift_(4))
    out.copy_(q.view(n, 256)).view(n, 8, 32).mul_(d).sub_(dm)


def _q6_k(b: torch.Tensor, out: torch.Tensor) -> None:
    n = b.shape[0]
    d = (_f16(b, 208) * b[:, 192:208].contiguous().view(torch.int8).float()).view(n, 16, 1)
    low = _nibbles(b, 0, 128, groups=2).view(n, 2, 4, 32)  # halves x (lo 64, hi 64)
    high = _fields(b, 128, 192, (0, 2, 4, 6), 3, groups=2)  # (n, 2, 4, 32)
    q = low.bitwise_or_(high.bitwise_left_shift_(4)).sub_(32)  # uint8 wraps: as int8, -32..31
    out.copy_(q.view(n, 256).view(torch.int8)).view(n, 16, 16).mul_(d)


_BLOCKS: dict[Q, Callable[[torch.Tensor, torch.Tensor], None]] = {
    Q.Q4_0: _q4_0, Q.Q4_1: _q4_1, Q.Q5_0: _q5_0, Q.Q5_1: _q5_1, Q.Q8_0: _q8_0, Q.Q8_K: _q8_k,
    Q.Q2_K: _q2_k, Q.Q3_K: _q3_k, Q.Q4_K: _q4_k, Q.Q5_K: _q5_k, Q.Q6_K: _q6_k,
}
_PLAIN = {Q.F32: torch.float32, Q.F16: torch.float16, Q.BF16: torch.bfloat16}
# Values per dequantization step on a CPU. Fewer, larger steps win while their temporaries stay
# small enough for malloc to reuse (not fault in afresh): 2^20 measured best of 2^17..2^23.
_CPU_CHUNK = 1 << 20
_HUGE_PAGES_FROM = 1 << 22  # bytes: outputs this large are advised onto transparent huge pages
SUPPORTED_TYPES: tuple[str, ...] = tuple(t.name for t in (*_PLAIN, *_BLOCKS))


def _madvise_huge(t: torch.Tensor) -> None:
    """Ask Linux to back ``t``'s whole pages with 2 MiB pages before anything touches them.

    A fresh output is faulted in page by page on its first write; at 4 KiB a page that took
    ~1.6 ns per float32 on the 2-core VM, more than dequantizing it (docs/benchmarks.md). Advice
    only: a no-op where transparent huge pages are off (``never``), skipped off Linux.
    """
    if _MADVISE is None:
        return
    start = t.data_ptr()
    first, last = (start + 4095) & ~4095, (start + t.numel() * t.element_size()) & ~4095
    if last > first:
        _MADVISE(first, last - first, 14)  # MADV_HUGEPAGE; the result is advisory, unchecked


def _libc_madvise() -> Callable[[int, int, int], int] | None:
    if sys.platform != "linux":
        return None
    fn = getattr(ctypes.CDLL(None), "madvise", None)
    if fn is not None:
        fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return fn


_MADVISE = _libc_madvise()


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
    ``device`` before they are unpacked, so a GPU does the arithmetic. The values are computed in
    float32 (as gguf's numpy does) and rounded once to ``dtype``. ``ValueError`` names the tensor
    and its type when the type has no dequantizer here or the byte count does not fit.
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
    blocks = raw.view(-1, type_size)  # (n_blocks, type_size)
    out = torch.empty((blocks.shape[0], block_size), dtype=dtype, device=raw.device)
    on_cpu = raw.device.type == "cpu"
    if on_cpu and out.numel() * out.element_size() >= _HUGE_PAGES_FROM:
        _madvise_huge(out)
    # A GPU takes the tensor whole; a CPU goes in slices whose temporaries stay in cache.
    step = max(1, _CPU_CHUNK // block_size) if on_cpu else blocks.shape[0]
    for start in range(0, blocks.shape[0], step):
        chunk, dest = blocks[start:start + step], out[start:start + step]  # (m, type_size), (m, block)
        if dtype == torch.float32:
            _BLOCKS[qtype](chunk, dest)
        else:  # float32 first, as gguf's numpy computes, then one rounding into the engine's dtype
            f32 = torch.empty(dest.shape, device=raw.device)
            _BLOCKS[qtype](chunk, f32)
            dest.copy_(f32)
    return out.reshape(tuple(shape))


def dequantize(
    tensor: ReaderTensor, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> torch.Tensor:
    """A ``gguf`` reader tensor as a torch tensor of its logical shape (rows first), dequantized."""
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    return dequantize_bytes(tensor.data, tensor.tensor_type, shape, dtype, device, name=tensor.name)
