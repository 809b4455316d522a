"""What one engine quantizes (``plan_quantization``): the layers' projections and the LM head, each
``none`` / ``int8`` / ``int4``, from the ``quantization`` asked and, for ``auto``, the GGUF
checkpoint's tensor types (``batchinfer.workers.quantization_config`` has the rules)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from batchinfer.workers.models.gguf import GGUFFile, gguf_path
from batchinfer.workers.quantization_config import QuantPlan, check_mode, resolve_quantization

# The GGUF tensors QuantizedLinear replaces: the layers' attention and MLP projections (Phi-3's
# fused attn_qkv included). MoE experts (ffn_*_exps, ffn_*_shexp) stay dense and do not count.
_LAYER_LINEAR = re.compile(r"blk\.\d+\.(attn_(q|k|v|qkv|output)|ffn_(gate|up|down))\.weight")


@dataclass(frozen=True)
class CheckpointTypes:
    """The GGUF tensor types ``auto`` reads: the layers' projections' and the LM head's."""

    layers: frozenset[str]
    head: str | None  # output.weight's, or token_embd.weight's when the head is tied to it


def gguf_types(model: str | Path) -> CheckpointTypes | None:
    """The tensor types of the GGUF checkpoint ``model`` names (a file, or a folder holding one);
    None for a Hugging Face folder. Opens the file's header (about half a second for the demo)."""
    if gguf_path(model) is None:
        return None
    tensors = GGUFFile(model).tensors
    layers = frozenset(t.tensor_type.name for name, t in tensors.items() if _LAYER_LINEAR.fullmatch(name))
    head = tensors.get("output.weight") or tensors.get("token_embd.weight")
    return CheckpointTypes(layers, None if head is None else head.tensor_type.name)


def plan_quantization(mode: str, model: str | Path, device: str, tensor_parallel_size: int = 1) -> QuantPlan:
    """The plan of ``mode`` for ``model`` on ``device``: int8 everywhere, int4 in the layers with an
    int8 LM head (both checked by ``check_quantization``), ``auto`` as ``quantization_config`` says
    (``none`` on a CUDA device or with tensor parallelism, where the packed kernels do not run)."""
    if check_mode(mode) != "auto":
        # int4 keeps the LM head at int8, as llama.cpp's 4-bit mixes keep their output tensor at 6 to
        # 8 bits: requantized to 4 bits, SmolLM2's tied head cut its greedy agreement with float32
        # from 0.54 to 0.11 (docs/engine.md, Quantized and bfloat16 weights)
        return QuantPlan(mode, "int8" if mode == "int4" else mode)
    if not str(device).startswith("cpu") or tensor_parallel_size > 1:
        return QuantPlan()
    types = gguf_types(model)
    if types is None:
        return QuantPlan()
    head = "none" if types.head is None else resolve_quantization("auto", [types.head])
    return QuantPlan(resolve_quantization("auto", types.layers), head)


