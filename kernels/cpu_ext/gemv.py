"""Dense matmuls of one to eight rows on the CPU (``gemv.cpp``): a linear layer at a decode step
of a few sequences, where the step is bound by how fast the weights stream in from memory: the
kernel prefetches the rows it will read next, and reads float32 / bfloat16 / float16 weights at
1.3-3x the rate of torch's ``F.linear`` at these row counts (docs/benchmarks.md, "The layer loop").

``workers/quant/dense.py``'s ``GemvLinear`` calls ``linear`` when ``supports`` says so; the library
and its switch are ``decode``'s (``BATCHINFER_CPU_DECODE_KERNEL``).
"""

from __future__ import annotations

import functools

import torch

from batchinfer.kernels.cpu_ext import decode

MAX_ROWS = 8  # activation rows a dense call takes (gemv.cpp's MAX_ROWS; from 9 on torch is as fast)
INT8_MAX_ROWS = 4  # and an int8 one (gemv.cpp's INT8_MAX_ROWS)
INT8_VNNI_MAX_ROWS = 8  # an int8 one where int8_vnni() (gemv.cpp's INT8_VNNI_MAX_ROWS)
WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
LANES = 16  # in_features must be a multiple of it


def supports(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``linear(x, weight)`` runs here now: x ``[M <= MAX_ROWS, K]`` with a contiguous last
    axis, a contiguous CPU weight of ``WEIGHT_DTYPES`` with ``K % LANES == 0``, and the library
    usable (``decode.usable``). Not one row of float16 weights: there torch's product is faster
    (0.8x; the kernel's half-to-float conversion costs more than the memory it saves). The compiled
    layer loop asks the same in C++ (``gemv_dense_takes``; ``gemv_int8_takes`` for ``int8_supports``)."""
    return (x.dim() == 2 and 0 < x.shape[0] <= MAX_ROWS and x.stride(-1) == 1
            and weight.dtype in WEIGHT_DTYPES and weight.shape[1] % LANES == 0 and weight.is_contiguous()
            and not (x.shape[0] == 1 and weight.dtype == torch.float16) and decode.usable(x))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``torch.nn.functional.linear(x, weight, bias)`` for ``[M, K] x [N, K] -> [M, N]`` in x's
    dtype (float32 sums; see ``gemv.cpp``). Raises ``RuntimeError`` outside ``supports``."""
    return decode.library().gemv_dense(x, weight, bias)


def int8_runs() -> bool:
    """Whether the int8 kernel runs here: the library switched on and built, on a CPU with AVX-512."""
    return decode.kernel_mode() != "0" and _int8_built()


@functools.cache
def _int8_built() -> bool:  # the build and the CPU do not change within a process
    library = decode.library()
    return library is not None and bool(library.gemv_int8_runs())


def int8_vnni() -> bool:
    """Whether the int8 kernel runs here with 16-bit integer activations (AVX512-VNNI's ``vpdpwssd``;
    ``gemv.cpp``'s ``rows_i8_vnni``) rather than widening every code to float32."""
    return int8_runs() and _int8_vnni_built()


def int8_max_rows() -> int:
    """The most activation rows ``linear_int8`` takes here: ``INT8_VNNI_MAX_ROWS`` where ``int8_vnni``
    (from 5 to 8 rows 1.14-1.22x the GEMV on a dense bfloat16 copy, `bench/engine_cpu.py --linear`),
    else ``INT8_MAX_ROWS`` (above it the float32 kernel loses to that copy)."""
    return INT8_VNNI_MAX_ROWS if _int8_built() and _int8_vnni_built() else INT8_MAX_ROWS


@functools.cache
def _int8_vnni_built() -> bool:
    return bool(decode.library().gemv_int8_vnni())


def int8_supports(x: torch.Tensor, q: torch.Tensor) -> bool:
    """Whether ``linear_int8(x, q, ...)`` runs here now: x ``[M <= int8_max_rows(), K]`` with a
    contiguous last axis (a CPU tensor of ``decode.DTYPES``), contiguous int8 codes with ``K % LANES
    == 0``, and ``int8_runs``."""
    return (x.dim() == 2 and x.shape[0] > 0 and x.stride(-1) == 1 and q.dtype == torch.int8
            and q.shape[1] % LANES == 0 and q.is_contiguous() and decode.usable(x) and _int8_built()
            and x.shape[0] <= int8_max_rows())


def linear_int8(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor,
                bias: torch.Tensor | None = None, *, widen: bool = False) -> torch.Tensor:
    """``(x @ q.T) * scales (+ bias)`` for int8 codes ``q [N, K]`` with one scale per output row,
    ``[M, K] -> [M, N]`` in x's dtype: what ``torch._weight_int8pack_mm`` computes (float32 sums,
    scaled, rounded), 1.6-2.4x faster at 1-4 rows. Where ``int8_vnni`` holds (up to 8 rows), each
    activation row goes in as 16-bit integers in units of a power of two per 4,096 features (exact
    for a bfloat16 value within 2^-7 of the largest magnitude, rounded at 2^-16 of it below) and the
    products add exactly; ``widen`` keeps the float32 kernel (up to 4 rows). Raises ``RuntimeError``
    outside ``int8_supports``."""
    library = decode.library()
    return (library.gemv_int8_widened if widen else library.gemv_int8)(x, q, scales, bias)
