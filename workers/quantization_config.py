"""The ``quantization`` setting (``EngineConfig.quantization``): its modes, its checks, and the
precision class of GGUF tensor types that ``auto`` reads. Pure: no torch at import, no models
(``batchinfer.workers.quant`` holds the quantized layers and ``quant.plan`` reads the checkpoint).

- ``none``: the weights as loaded, in the engine's dtype (the default).
- ``int8``: each linear weight quantized per output channel, symmetric (``QuantizedLinear``).
- ``int4``: groups of 32 weights along the input, asymmetric (min/max); a shape the int4 pack
  cannot hold (``quant.linear.packed_mode``) is int8 instead, and so is the LM head (the logits
  are what greedy decoding reads: requantized to 4 bits, SmolLM2's head cost most of its agreement).
- ``auto``: a GGUF checkpoint keeps the precision class of its tensors, the layers' projections by
  their types and the LM head by its own (``resolve_quantization``): a 4-bit file (Q4_0, Q4_1,
  Q4_K, and the 2/3-bit K and IQ types) runs int4, a 5 to 8-bit one (Q5_*, Q6_K, Q8_0) int8 (int4
  would drop bits the file has), float tensors stay dense. The demo SmolLM2 (Q4_1 layers, a Q8_0
  tied embedding) runs int4 layers and an int8 head. A Hugging Face folder is ``none`` (its dtype
  is its precision), and so is every checkpoint where the packed kernels do not run (a CUDA
  device, tensor parallelism).

The quantized modes run the packed kernels of torch's CPU backend, which take bfloat16
activations only: with int8 / int4 the engine runs in bfloat16 (``dtype`` float32 -> bfloat16;
float16 is refused), on the CPU, without tensor parallelism; ``check_quantization`` says so
with a ``ValueError`` that starts with ``quantization``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

QUANTIZATION_MODES = ("none", "int8", "int4", "auto")
WEIGHT_MODES = ("int8", "int4")  # the modes that quantize (what a layer ends up in, besides none)

# GGUF tensor types (gguf.GGMLQuantizationType names) by the mode that keeps their precision.
_FLOAT_TYPES = frozenset({"F32", "F16", "BF16", "F64"})
_INT4_TYPES = frozenset({  # 4 bits a weight or fewer
    "Q4_0", "Q4_1", "Q4_K", "Q2_K", "Q3_K", "Q1_0", "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S",
    "IQ3_XXS", "IQ3_S", "IQ4_NL", "IQ4_XS", "TQ1_0", "TQ2_0", "MXFP4", "NVFP4"})
_INT8_TYPES = frozenset({"Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_0", "Q8_1", "Q8_K"})  # 5 to 8 bits


def check_mode(mode: Any) -> str:
    """``mode`` if it is one of ``QUANTIZATION_MODES``, else a ValueError naming ``quantization``."""
    if not isinstance(mode, str) or mode not in QUANTIZATION_MODES:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_MODES)}, got {mode!r}")
    return mode


def type_mode(gguf_type: str) -> str:
    """The mode that keeps a GGUF tensor type's precision: ``"none"``, ``"int8"`` or ``"int4"``."""
    name = str(gguf_type).upper()
    if name in _FLOAT_TYPES:
        return "none"
    if name in _INT4_TYPES:
        return "int4"
    if name in _INT8_TYPES:
        return "int8"
    raise ValueError(f"quantization 'auto': GGUF tensor type {gguf_type!r} has no precision class "
                     "(give quantization none, int8 or int4)")


def resolve_quantization(mode: str, gguf_types: Iterable[str] | None) -> str:
    """What ``mode`` quantizes weights of these GGUF tensor types to: ``"none"``, ``"int8"`` or ``"int4"``.

    ``none`` / ``int8`` / ``int4`` are themselves. ``auto``: ``gguf_types`` None (a Hugging Face
    folder) or only float types -> ``none``; any 4-bit-or-fewer type -> ``int4`` (a Q4_K_M file's
    Q6_K tensors go along with its Q4_K ones); else any 5 to 8-bit type -> ``int8``. ValueError
    (``quantization ...``) for an unknown mode or type.
    """
    if check_mode(mode) != "auto":
        return mode
    if gguf_types is None:
        return "none"
    modes = {type_mode(t) for t in gguf_types}
    return "int4" if "int4" in modes else "int8" if "int8" in modes else "none"


@dataclass(frozen=True)
class QuantPlan:
    """What one engine quantizes: the layers' projections and the LM head (each none, int8 or int4)."""

    layers: str = "none"
    head: str = "none"

    @property
    def active(self) -> bool:
        """Whether anything is quantized (then the model runs in bfloat16)."""
        return self.layers != "none" or self.head != "none"


def quantized_dtype(mode: str, dtype: str | torch.dtype) -> torch.dtype:
    """The dtype a model quantized with ``mode`` runs in: bfloat16 (the packed kernels take bfloat16
    activations), for a ``dtype`` of bfloat16 or float32; float16 is a ValueError."""
    import torch

    if str(dtype).removeprefix("torch.") in ("float16", "half"):
        raise ValueError(f"quantization {mode!r} runs in bfloat16 (torch's packed CPU kernels take "
                         "bfloat16 activations): dtype float16 cannot go with it; give bfloat16 "
                         "or float32 (which then runs in bfloat16)")
    return torch.bfloat16


def check_quantization(mode: Any, dtype: str | torch.dtype, device: str,
                       tensor_parallel_size: int = 1) -> str | torch.dtype:
    """``EngineConfig``'s check: the dtype the engine runs in (bfloat16 for int8 / int4, else
    ``dtype`` unchanged). ValueError starting with ``quantization`` for an unknown mode, and for
    int8 / int4 on a CUDA device, with tensor parallelism, with float16, or on a torch without
    the packed kernels."""
    check_mode(mode)
    if mode not in WEIGHT_MODES:
        return dtype  # none; auto is settled when the engine has read the checkpoint
    if not str(device).startswith("cpu"):
        raise ValueError(f"quantization {mode!r} runs torch's packed CPU kernels: device must be cpu, "
                         f"got {device!r} (use quantization none on a GPU)")
    if tensor_parallel_size > 1:
        raise ValueError(f"quantization {mode!r} is not supported with tensor_parallel_size "
                         f"{tensor_parallel_size} (the row-parallel layers read dense weights); "
                         "run one worker per device instead")
    import torch

    kernel = "_weight_int8pack_mm" if mode == "int8" else "_weight_int4pack_mm_for_cpu"
    if not hasattr(torch.ops.aten, kernel):
        raise ValueError(f"quantization {mode!r} needs torch's {kernel} kernel, which torch "
                         f"{torch.__version__} lacks (torch 2.6 or later has it)")
    return quantized_dtype(mode, dtype)
