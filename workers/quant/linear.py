"""``QuantizedLinear``: an ``nn.Linear`` whose weight is int8 or int4, run by torch's packed CPU kernels.

int8: ``q = round(w / s)`` in [-127, 127] per output channel, ``s = max|w_row| / 127`` (bfloat16);
the weight is ``q * s``. Kernel: ``torch._weight_int8pack_mm(x, q [N, K] int8, s [N])``, or where
it runs (AVX-512, up to 4 rows; 8 with VNNI) the compiled ``kernels.cpu_ext.gemv.linear_int8``, which
computes the same and streams the codes 1.4-2x faster (with AVX512-VNNI from 16-bit integer activations: the
same sums up to their last float32 bits for bfloat16 activations; docs/kernels.md).

int4: groups of ``GROUP_SIZE`` weights along the input dimension (K), asymmetric: ``q`` in [0, 15],
the weight is ``(q - 8) * scale + zero`` with ``scale = (max - min) / 15`` and ``zero = min + 8 *
scale`` per group (bfloat16). A GGUF Q4_0 / Q4_1 block is such a group of 32, so requantizing its
dequantized values finds the file's own 4-bit codes again; only scale and zero are rounded to
bfloat16. Kernel: ``torch._weight_int4pack_mm_for_cpu(x, pack(q), GROUP_SIZE, scales_and_zeros)``.

Both kernels take bfloat16 activations (float32 ones fall on a path ~30x slower), and both lose
to a dense bfloat16 matmul as the row count grows: each dequantizes its weight tile by tile for
every call, which a dense matmul amortises over the rows. So the module also keeps ``weight``,
the dense bfloat16 copy of the *quantized* weights (``q * s`` rounded to bfloat16), and a step of
M rows runs the packed kernel when ``M <= packed_max_rows(mode)`` (``PACKED_MAX_ROWS``; 8 for int8
where the compiled kernel runs with VNNI), the dense copy otherwise (up to
``gemv.MAX_ROWS`` rows through the compiled GEMV, as ``GemvLinear`` runs): the same
weights either way, up to that one bfloat16 rounding of each (the kernels compute ``q * s`` in
float32). Memory per weight: int8 1 byte + 2 (the copy), int4 0.5 + 1/8 (scale and zero per 32)
+ 2: more than bfloat16's 2 bytes, less than float32's 4. What quantization buys is decode speed
at low concurrency, where reading the weights is the step's cost.

Shape limits (``packed_mode``): int8 needs K % 16 == 0 (torch's kernel reads out of bounds
otherwise); int4 needs K % 32 == 0 and N % 16 == 0, and falls back to int8 where they fail.
"""

from __future__ import annotations

import torch
from torch import nn

from batchinfer.kernels.cpu_ext import gemv

GROUP_SIZE = 32  # int4: weights per scale/zero group along K (a GGUF Q4_0 / Q4_1 block)
INNER_K_TILES = 8  # int4: the CPU pack's tile parameter (the value torch's own int4 CPU path uses)
# Crossover of the packed kernels and a dense bfloat16 matmul, measured with 1 thread on this repo's
# dev CPU (AMD EPYC with avx512_bf16), microseconds per call for the SmolLM2-135M shapes N x K:
#   960 x 576 (qkv):   M=1 int8 30 int4 31 bf16 58 | M=4 58 53 67 | M=6 97 89 77  | M=8 114 104 87
#   3072 x 576 (gate_up): M=1 93 95 142          | M=4 192 167 176 | M=6 319 284 202
#   576 x 1536 (down): M=1 45 48 80             | M=4 89 84 93   | M=6 148 141 108 | M=16 352 330 185
# The packed kernels win up to 4 rows (by ~2x at one) and lose from 6 on.
PACKED_MAX_ROWS = 4


def packed_max_rows(mode: str) -> int:
    """Up to how many rows a ``mode`` layer runs its quantized kernel (more: the dense copy):
    ``PACKED_MAX_ROWS``, or for int8 where the compiled kernel takes activations as 16-bit integers
    (``gemv.int8_vnni``) its 8 rows, 1.14-1.22x the GEMV on the dense bfloat16 copy at 5-8 rows
    (docs/benchmarks.md, "int8 through VNNI")."""
    return gemv.int8_max_rows() if mode == "int8" and gemv.int8_runs() else PACKED_MAX_ROWS


def packed_mode(mode: str, out_features: int, in_features: int) -> str:
    """The mode a weight of ``[out_features, in_features]`` can take when ``mode`` is asked:
    ``mode`` itself, ``"int8"`` for an int4 shape the pack cannot hold, ``"none"`` when neither
    kernel takes it (it stays dense)."""
    if mode == "int4" and (in_features % GROUP_SIZE or out_features % 16):
        mode = "int8"
    if mode == "int8" and in_features % 16:
        mode = "none"
    return mode


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` [N, K] -> (q [N, K] int8, scales [N] bfloat16), symmetric per output channel."""
    w = w.float()
    scales = (w.abs().amax(dim=1) / 127).to(torch.bfloat16)  # [N]
    s = scales.float().unsqueeze(1)  # [N, 1]: q is rounded against the scale the kernel will use
    q = torch.where(s > 0, torch.round(w / s.clamp(min=torch.finfo(torch.float32).tiny)), 0.0)
    return q.clamp_(-127, 127).to(torch.int8), scales


def quantize_int4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` [N, K] -> (q [N, K] int32 in [0, 15], scales_and_zeros [K / 32, N, 2] bfloat16):
    ``w ~ (q - 8) * scale + zero`` per group of ``GROUP_SIZE`` along K (min/max, asymmetric)."""
    n, k = w.shape
    wg = w.float().reshape(n, k // GROUP_SIZE, GROUP_SIZE)  # [N, G, 32]
    lo, hi = wg.amin(dim=-1), wg.amax(dim=-1)  # [N, G]
    scale = ((hi - lo) / 15).to(torch.bfloat16).float()  # rounded first: q is found against it
    zero = (lo + 8 * scale).to(torch.bfloat16).float()
    s = scale.unsqueeze(-1)  # [N, G, 1]; a constant group has scale 0: q = 8, every weight = its zero
    tiny = torch.finfo(torch.float32).tiny
    q = torch.where(s > 0, torch.round((wg - zero.unsqueeze(-1)) / s.clamp(min=tiny)) + 8, 8.0)
    q = q.clamp_(0, 15).to(torch.int32).reshape(n, k)
    scales_and_zeros = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous()  # [G, N, 2]
    return q, scales_and_zeros.to(torch.bfloat16)


def dequantize_int8(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """(q [N, K] int8, scales [N]) -> the weights [N, K] in float32, as the int8 kernel sees them."""
    return q.float() * scales.float().unsqueeze(1)


def dequantize_int4(q: torch.Tensor, scales_and_zeros: torch.Tensor) -> torch.Tensor:
    """(q [N, K] in [0, 15], scales_and_zeros [K / 32, N, 2]) -> the weights [N, K] in float32, as
    the int4 kernel sees them: ``(q - 8) * scale + zero`` per group."""
    n, k = q.shape
    sz = scales_and_zeros.float().transpose(0, 1).unsqueeze(2)  # [N, G, 1, 2]
    w = (q.reshape(n, k // GROUP_SIZE, GROUP_SIZE).float() - 8) * sz[..., 0] + sz[..., 1]  # [N, G, 32]
    return w.reshape(n, k)


class QuantizedLinear(nn.Module):
    """``y = x @ W.T + b`` with ``W`` int8 or int4 (the module docstring); ``[..., K] -> [..., N]``.

    Built from a weight (``from_linear``: an ``nn.Linear``'s); ``mode`` is what it got (see
    ``packed_mode``: ValueError for a shape the asked mode cannot pack). Buffers: int8 ``qweight``
    [N, K] int8 and ``scales`` [N]; int4 ``qweight`` (the CPU pack, [N, K / 2] uint8) and
    ``scales_and_zeros`` [K / 32, N, 2]; both ``weight`` [N, K] (the dense bfloat16 copy) and
    ``bias`` [N] or None. Outputs are in the input's dtype, computed in bfloat16.
    """

    weight: torch.Tensor  # [N, K] bfloat16: the dense copy of the quantized weights
    qweight: torch.Tensor
    scales: torch.Tensor  # int8 only
    scales_and_zeros: torch.Tensor  # int4 only
    bias: torch.Tensor | None

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, mode: str) -> None:
        super().__init__()
        n, k = weight.shape
        if weight.device.type != "cpu":
            raise ValueError(f"quantization {mode!r} runs torch's packed CPU kernels; the weight is on "
                             f"{weight.device}")
        if mode not in ("int8", "int4") or packed_mode(mode, n, k) != mode:
            raise ValueError(f"quantization {mode!r} cannot pack a [{n}, {k}] weight "
                             f"(it would be {packed_mode(mode, n, k)!r}; see packed_mode)")
        self.mode = mode
        self.in_features, self.out_features = k, n
        self.packed_max_rows = packed_max_rows(mode)  # per module, so that a test can force either path
        with torch.no_grad():
            if mode == "int8":
                q, scales = quantize_int8(weight)
                self.register_buffer("qweight", q)  # [N, K] int8
                self.register_buffer("scales", scales)  # [N] bfloat16
                dense = dequantize_int8(q, scales)
            else:
                q, scales_and_zeros = quantize_int4(weight)
                self.register_buffer("qweight", torch._convert_weight_to_int4pack_for_cpu(q, INNER_K_TILES))
                self.register_buffer("scales_and_zeros", scales_and_zeros)  # [K / 32, N, 2] bfloat16
                dense = dequantize_int4(q, scales_and_zeros)
            self.register_buffer("weight", dense.to(torch.bfloat16))  # [N, K]
            self.register_buffer("bias", None if bias is None else bias.detach().to(torch.bfloat16).clone())

    @classmethod
    def from_linear(cls, linear: nn.Linear, mode: str) -> QuantizedLinear:
        """The quantized copy of ``linear`` (its weight [N, K] and bias)."""
        return cls(linear.weight.detach(), linear.bias, mode)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., K] -> [..., N]
        x2 = x.reshape(-1, self.in_features)  # [M, K]
        if x2.dtype != torch.bfloat16:
            x2 = x2.to(torch.bfloat16)
        if x2.shape[0] > self.packed_max_rows:  # dense: faster from a few rows on (PACKED_MAX_ROWS)
            if gemv.supports(x2, self.weight):  # up to gemv.MAX_ROWS rows: the compiled GEMV
                return self._out(gemv.linear(x2, self.weight, self.bias), x)
            y = torch.nn.functional.linear(x2, self.weight, self.bias)  # [M, N]
        else:
            x2 = x2.contiguous()  # both kernels refuse strided rows (a broadcast row, say)
            if self.mode == "int8" and gemv.int8_supports(x2, self.qweight):  # the compiled one: faster
                return self._out(gemv.linear_int8(x2, self.qweight, self.scales, self.bias), x)
            if self.mode == "int8":
                y = torch._weight_int8pack_mm(x2, self.qweight, self.scales)  # [M, N]
            else:
                y = torch._weight_int4pack_mm_for_cpu(x2, self.qweight, GROUP_SIZE, self.scales_and_zeros)
            if self.bias is not None:
                y = y + self.bias
        return self._out(y, x)

    def _out(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:  # [M, N] -> [..., N] in x's dtype
        if y.dtype != x.dtype:
            y = y.to(x.dtype)
        return y if x.dim() == 2 else y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, mode={self.mode}, "
                f"bias={self.bias is not None}, packed_max_rows={self.packed_max_rows}")
