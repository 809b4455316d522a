"""Dense matmuls of one to four rows on the CPU (``gemv.cpp``): a linear layer at a decode step
of a few sequences, where the step is bound by how fast the weights stream in from memory: the
kernel prefetches the rows it will read next, and reads float32 / bfloat16 / float16 weights at
1.7-3x the rate of torch's ``F.linear`` at these row counts (docs/benchmarks.md, "The layer loop").

``workers/quant/dense.py``'s ``GemvLinear`` calls ``linear`` when ``supports`` says so; the library
and its switch are ``decode``'s (``BATCHINFER_CPU_DECODE_KERNEL``).
"""

from __future__ import annotations

import torch

from batchinfer.kernels.cpu_ext import decode

MAX_ROWS = 4  # activation rows a call takes (gemv.cpp's MAX_ROWS; from 5 on torch is as fast)
WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
LANES = 16  # in_features must be a multiple of it


def supports(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``linear(x, weight)`` runs here now: x ``[M <= MAX_ROWS, K]`` with a contiguous last
    axis, a contiguous CPU weight of ``WEIGHT_DTYPES`` with ``K % LANES == 0``, and the library
    usable (``decode.usable``)."""
    return (x.dim() == 2 and x.shape[0] <= MAX_ROWS and x.shape[0] > 0 and x.stride(-1) == 1
            and weight.dtype in WEIGHT_DTYPES and weight.shape[1] % LANES == 0 and weight.is_contiguous()
            and decode.usable(x))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``torch.nn.functional.linear(x, weight, bias)`` for ``[M, K] x [N, K] -> [M, N]`` in x's
    dtype (float32 sums; see ``gemv.cpp``). Raises ``RuntimeError`` outside ``supports``."""
    return decode.library().gemv_dense(x, weight, bias)
