"""``LayerLoop``: a CPU decoder's decode steps through the compiled layer loop.

At one token a sequence, the Python around a layer's ops (module calls, views, the wrappers'
checks) costs ~200 us a layer, more than the ops of a small model. ``kernels/cpu_ext/layers.py``
runs the whole loop in one C++ call, the same ops in the same order: the hidden states are the
Python path's bit for bit. ``use_layer_loop`` attaches a ``LayerLoop`` to a loaded decoder
(``Decoder.layer_loop``), after ``quantize_model`` and ``use_gemv`` have settled its linears: it
holds their tensors, and a decoder whose modules change afterwards needs a new one.

Which decoders: plain pre-norm blocks on the CPU (``unsupported_reason`` names what is not:
sandwich or unit-offset norms, per-head q/k norms, GeGLU, MoE, soft-capping, a second RoPE
table, tensor parallelism, a head_dim the decode kernel does not take). Which steps: decode steps
(every sequence at most one query) without LoRA adapters, whose caches the kernels take and whose
attention backend resolves to ``cpu``; the rest (prefill, mixed and speculative steps) run in
Python, as does everything when ``BATCHINFER_CPU_DECODE_KERNEL=0`` or the library did not build.
"""

from __future__ import annotations

import torch
from torch import nn

from batchinfer.kernels.cpu_ext import decode, elementwise, gemv, layers
from batchinfer.kernels.dispatch import select_backend
from batchinfer.workers.models.attention import AttentionMetadata
from batchinfer.workers.models.decoder import MLP, Decoder, DecoderLayer, KVCache, RMSNorm
from batchinfer.workers.quant.dense import GemvLinear
from batchinfer.workers.quant.linear import QuantizedLinear


def unsupported_reason(decoder: Decoder) -> str | None:
    """Why ``decoder``'s layers cannot run in the compiled loop, or None when they can."""
    if decoder.device.type != "cpu" or decoder.dtype not in decode.DTYPES:
        return f"a {decoder.dtype} model on {decoder.device} (the loop: float32, bfloat16, float16; CPU)"
    if decoder.tp is not None:
        return "tensor parallelism"
    if decoder.num_layers == 0:
        return "no layers"
    if decoder.cos_sin_local is not None:
        return "a second RoPE table for sliding layers"
    table = decoder.cos_sin_cache
    if table.dtype != torch.float32 or table.shape[-1] > elementwise.MAX_ROTARY_DIM or table.stride(-1) != 1:
        return "a RoPE table the fused rotary op does not take"
    if decoder.head_dim % decode.LANES:
        return f"head_dim {decoder.head_dim} is not a multiple of {decode.LANES}"
    norms = [decoder.norm]
    scales = set()
    for i, layer in enumerate(decoder.layers):
        assert isinstance(layer, DecoderLayer)
        attn, mlp = layer.self_attn, layer.mlp
        if layer.pre_feedforward_layernorm is not None or layer.post_feedforward_layernorm is not None:
            return f"layer {i}: sandwich norms"
        if attn.q_norm is not None or attn.k_norm is not None:
            return f"layer {i}: per-head q/k norms"
        if attn.softcap is not None:
            return f"layer {i}: soft-capped attention"
        if not isinstance(mlp, MLP) or mlp.gelu_tanh:
            return f"layer {i}: {'GeGLU' if isinstance(mlp, MLP) else 'a mixture-of-experts block'}"
        for name, linear in _linears(layer):
            if _kind(linear, decoder.dtype) is None:
                return f"layer {i}: {name} is a {type(linear).__name__} of {linear.weight.dtype}"
        norms += [layer.input_layernorm, layer.post_attention_layernorm]
        scales.add(attn.scale)
    if any(n.unit_offset or n.weight.dtype != decoder.dtype or n.eps != decoder.norm.eps for n in norms):
        return "norms with a unit offset, another dtype or another eps"
    if len(scales) != 1:
        return "layers with different attention scales"
    return None


def _linears(layer: DecoderLayer) -> list[tuple[str, nn.Module]]:
    mlp = layer.mlp
    assert isinstance(mlp, MLP)
    return [("qkv_proj", layer.self_attn.qkv_proj), ("o_proj", layer.self_attn.o_proj),
            ("gate_up_proj", mlp.gate_up_proj), ("down_proj", mlp.down_proj)]


def _kind(linear: nn.Module, dtype: torch.dtype) -> int | None:
    """How ``linear`` runs (``layers.TORCH`` ...), as its own ``forward`` would; None: not here."""
    if isinstance(linear, QuantizedLinear):
        return layers.INT8 if linear.mode == "int8" else layers.INT4
    if type(linear) not in (nn.Linear, GemvLinear) or linear.weight.dtype != dtype:
        return None
    w = linear.weight
    assert isinstance(w, torch.Tensor)
    if (type(linear) is GemvLinear and w.dtype in gemv.WEIGHT_DTYPES and w.shape[1] % gemv.LANES == 0
            and w.is_contiguous()):
        return layers.GEMV  # the rest of GemvLinear's check is on x, which the loop's rows pass
    return layers.TORCH


def _slots(linear: nn.Module) -> list[torch.Tensor | None]:
    """``linear``'s ``layers.PER_LINEAR`` tensors: weight, qweight, scales, bias."""
    if isinstance(linear, QuantizedLinear):
        scales = linear.scales if linear.mode == "int8" else linear.scales_and_zeros
        return [linear.weight, linear.qweight, scales, linear.bias]
    assert isinstance(linear, nn.Linear)
    return [linear.weight, None, None, linear.bias]


class LayerLoop:
    """A decoder's layers (``unsupported_reason`` None) as one compiled call per decode step.

    ``__call__`` takes what ``Decoder.forward`` has after the embedding and returns the final
    hidden states, or None for a step it does not take (the caller runs its Python layers)."""

    def __init__(self, decoder: Decoder) -> None:
        reason = unsupported_reason(decoder)
        if reason is not None:
            raise ValueError(f"the compiled layer loop cannot run this decoder: {reason}")
        self.weights: list[torch.Tensor | None] = []
        self.kinds: list[int] = []
        self.packed_max_rows: list[int] = []
        self.sliding_windows: list[int] = []
        for layer in decoder.layers:
            assert isinstance(layer, DecoderLayer)
            self.weights += [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
            for _, linear in _linears(layer):
                kind = _kind(linear, decoder.dtype)
                assert kind is not None  # unsupported_reason checked every linear
                self.weights += _slots(linear)
                self.kinds.append(kind)
                self.packed_max_rows.append(getattr(linear, "packed_max_rows", 0))
            self.sliding_windows.append(layer.self_attn.sliding_window or 0)
        self.weights.append(decoder.norm.weight)
        first = decoder.layers[0]
        assert isinstance(first, DecoderLayer) and isinstance(decoder.norm, RMSNorm)
        self.num_heads, self.num_kv_heads = first.self_attn.num_heads, first.self_attn.num_kv_heads
        self.scale, self.eps = first.self_attn.scale, decoder.norm.eps
        self.dtype, self.head_dim = decoder.dtype, decoder.head_dim
        assert isinstance(decoder.cos_sin_cache, torch.Tensor)
        self.cos_sin = decoder.cos_sin_cache
        # The caches last seen, split into K and V lists, and whether (with which backend) they qualify.
        self._caches: list[KVCache] | None = None
        self._k: list[torch.Tensor] = []
        self._v: list[torch.Tensor] = []
        self._backend_ok: dict[str | None, bool] = {}

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                 meta: AttentionMetadata) -> torch.Tensor | None:  # [T, C] -> [T, C], or None
        if meta.max_seqlen_q != 1 or not elementwise.usable(x) or not self._takes(kv_caches, meta.backend):
            return None
        return layers.decode_layers(
            x, positions, self.cos_sin, meta.slot_mapping, meta.block_tables, meta.cu_seqlens_q,
            meta.seq_lens, self._k, self._v, self.weights, self.kinds, self.packed_max_rows,
            self.sliding_windows, self.num_heads, self.num_kv_heads, self.scale, self.eps)

    def _takes(self, kv_caches: list[KVCache], backend: str | None) -> bool:
        """Whether these caches, with this attention backend, are the loop's (checked once per set)."""
        if kv_caches is not self._caches:
            self._caches = kv_caches
            self._k = [k for k, _ in kv_caches]
            self._v = [v for _, v in kv_caches]
            self._backend_ok = {}
        ok = self._backend_ok.get(backend)
        if ok is None:
            k0 = self._k[0]
            ok = (all(c.dtype == self.dtype and c.dim() == 4 and c.stride(-1) == 1 and c.device.type == "cpu"
                      for c in (*self._k, *self._v))
                  and select_backend(backend, k0.device, k0.dtype, k0.shape[1], self.head_dim) == "cpu")
            self._backend_ok[backend] = ok
        return ok


def use_layer_loop(decoder: Decoder) -> bool:
    """Attach a ``LayerLoop`` to ``decoder`` when it can take one (``unsupported_reason``); returns
    whether it did. Call it once the decoder's linears are final (after ``quantize_model`` and
    ``use_gemv``). Whether the library is switched on and built is asked at each step."""
    decoder.layer_loop = LayerLoop(decoder) if unsupported_reason(decoder) is None else None
    return decoder.layer_loop is not None
