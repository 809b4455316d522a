"""``quantize_model``: a loaded ``Decoder``'s linear layers swapped for ``QuantizedLinear`` in place.

Replaced: every layer's ``qkv_proj``, ``o_proj`` and (dense MLP) ``gate_up_proj`` / ``down_proj``,
and the LM head. A head tied to the embedding (SmolLM2, Gemma) becomes a quantized copy of
``embed_tokens.weight`` in ``decoder.lm_head``, which ``compute_logits`` then runs; the embedding
lookup itself stays dense. Left dense: norms, the embedding, and MoE blocks whole (their experts
are stacked tensors run by the MoE kernels, not ``nn.Linear``; the router and shared expert go
with them). LoRA still works: adapters add their deltas to the projections' outputs and never
read the base weights.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

from torch import nn

from batchinfer.workers.models.decoder import MLP, Decoder, DecoderLayer
from batchinfer.workers.quant.linear import QuantizedLinear, packed_mode
from batchinfer.workers.quantization_config import WEIGHT_MODES


def projections(decoder: Decoder) -> Iterator[tuple[nn.Module, str]]:
    """(module, attribute name) of every layer's ``qkv_proj`` and ``o_proj`` and, in a dense MLP,
    ``gate_up_proj`` and ``down_proj`` (an MoE block's experts are stacked tensors, not linears)."""
    for layer in decoder.layers:
        assert isinstance(layer, DecoderLayer)
        yield from ((layer.self_attn, name) for name in ("qkv_proj", "o_proj"))
        if isinstance(layer.mlp, MLP):
            yield from ((layer.mlp, name) for name in ("gate_up_proj", "down_proj"))


def tied_head(decoder: Decoder) -> nn.Linear:
    """An ``nn.Linear`` [C] -> [V] whose weight is the embedding's own (shared, not copied)."""
    vocab, hidden = decoder.embed_tokens.weight.shape
    head = nn.Linear(hidden, vocab, bias=False, device="meta")
    head.weight = decoder.embed_tokens.weight  # [V, C]
    return head


def _quantized(linear: nn.Module, mode: str, counts: Counter[str]) -> nn.Module:
    """``linear`` quantized as its shape allows (``packed_mode``), or itself; counts what it became."""
    if isinstance(linear, QuantizedLinear) or not isinstance(linear, nn.Linear):
        return linear
    got = packed_mode(mode, linear.out_features, linear.in_features)
    counts[got] += 1
    return linear if got == "none" else QuantizedLinear.from_linear(linear, got)


def quantize_model(decoder: Decoder, mode: str, head_mode: str | None = None) -> dict[str, int]:
    """Quantize ``decoder``'s projections with ``mode`` and its LM head with ``head_mode`` (None:
    ``mode``), each ``"int8"``, ``"int4"`` or ``"none"``; returns how many linears ended in each
    mode (an int4 shape the pack cannot hold is int8; one neither kernel takes stays dense: "none").

    ValueError naming ``quantization`` for an unknown mode, a decoder on a CUDA device, or a
    tensor-parallel shard (its row-parallel layers read ``linear.weight`` for a partial product).
    """
    head_mode = mode if head_mode is None else head_mode
    for m in (mode, head_mode):
        if m not in ("none", *WEIGHT_MODES):
            raise ValueError(f"quantization must be none, int8 or int4 here, got {m!r}")
    if decoder.device.type != "cpu":
        raise ValueError(f"quantization {mode!r} runs torch's packed CPU kernels; the model is on "
                         f"{decoder.device}")
    if decoder.tp is not None:
        raise ValueError(f"quantization {mode!r} is not supported with tensor parallelism")
    counts: Counter[str] = Counter()
    if mode != "none":
        for holder, name in projections(decoder):
            setattr(holder, name, _quantized(getattr(holder, name), mode, counts))
    if head_mode != "none":
        head = decoder.lm_head
        if head is None:  # tied: a quantized copy of the embedding rows, the lookup stays dense
            head = tied_head(decoder)
        quantized = _quantized(head, head_mode, counts)
        if quantized is not head or decoder.lm_head is not None:
            decoder.lm_head = quantized
    return dict(counts)
