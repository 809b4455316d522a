"""GGUF tensor names -> the Hugging Face names the loader maps onto the decoder, and llama.cpp's
Q/K row permutation undone.

llama.cpp's ``convert_hf_to_gguf.py`` renames every tensor (``model.layers.3.self_attn.q_proj``
-> ``blk.3.attn_q``) and, for the ``llama`` architecture only, reorders the rows of q and k from
Hugging Face's half-split RoPE layout to GPT-J's interleaved one; ``unpermute_qk`` restores it
(transformers' ``LlamaTensorProcessor`` does the same). Architectures whose names differ add a
row to ``_ARCH_LAYER_NAMES``. Mixture-of-experts files stack every expert of a layer in one
tensor (``ffn_gate_exps`` ``[E, I, C]``); ``split_stacked`` cuts it into the per-expert tensors of
a Hugging Face checkpoint, so the loader's expert mapping serves both.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import torch

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# blk.N.<gguf> -> model.layers.N.<hf> (a ".weight" or ".bias" suffix follows both).
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    # Mixture of experts (Mixtral as llama, qwen2moe, qwen3moe): router, stacked experts, shared expert.
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
# Gemma 2 / 3 "sandwich" norms: llama.cpp's ffn_norm is the pre-feedforward norm there.
_GEMMA_LAYER_NAMES = {
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# Phi-3 keeps the checkpoint's fused projections: attn_qkv = [q; k; v] rows, ffn_up = [gate; up] rows.
_PHI3_LAYER_NAMES = {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}
# Per-architecture overrides of _LAYER_NAMES.
_ARCH_LAYER_NAMES: dict[str, dict[str, str]] = {
    "gemma2": _GEMMA_LAYER_NAMES, "gemma3": _GEMMA_LAYER_NAMES, "phi3": _PHI3_LAYER_NAMES}
# Model-level tensors that configure rather than weigh (Phi-3's LongRoPE factors): config.py reads them.
CONFIG_TENSORS = frozenset({"rope_factors_long.weight", "rope_factors_short.weight"})
_STACKED = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.(gate_proj|up_proj|down_proj)\.weight")
# Architectures whose RMSNorm scales by (1 + w): llama.cpp stores w + 1 (transformers subtracts it back).
NORM_OFFSET = frozenset({"gemma2", "gemma3"})
# Architectures whose q/k rows llama.cpp permutes on conversion.
PERMUTED_QK = frozenset({"llama", "mistral"})
_LAYER = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# Mixtral files from before llama.cpp stacked experts (early 2024): blk.N.ffn_gate.E.weight.
_LEGACY_EXPERT = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)\.(\d+)\.weight")


def hf_name(name: str, arch: str) -> str:
    """The Hugging Face name of GGUF tensor ``name``; ``ValueError`` naming it when unknown."""
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    legacy = _LEGACY_EXPERT.fullmatch(name)
    if legacy:
        layer, proj, expert = legacy.groups()
        return f"model.layers.{layer}.mlp.experts.{expert}.{proj}_proj.weight"
    match = _LAYER.fullmatch(name)
    if match:
        layer, part, kind = match.groups()
        table = layer_names(arch)
        if part in table:
            return f"model.layers.{layer}.{table[part]}.{kind}"
    raise ValueError(f"GGUF tensor {name!r} of a {arch!r} model has no counterpart in this decoder")


def layer_names(arch: str) -> dict[str, str]:
    """GGUF layer-tensor part -> Hugging Face part (after ``model.layers.N.``) for ``arch``."""
    return {**_LAYER_NAMES, **_ARCH_LAYER_NAMES.get(arch, {})}


def has_norm_offset(name: str, arch: str) -> bool:
    """True when GGUF tensor ``name`` is a norm weight stored as ``w + 1`` (Gemma)."""
    return arch in NORM_OFFSET and name.endswith("norm.weight")


def unpermute_qk(tensor: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's ``permute`` of q or k rows (``n_head`` = heads of that projection).

    llama.cpp: ``w.reshape(n_head, 2, rows // n_head // 2, ...).swapaxes(1, 2)``; this is its inverse.
    Works on weights ``(rows, cols)`` and biases ``(rows,)`` alike.
    """
    rows = tensor.shape[0]
    if rows % (2 * n_head):
        raise ValueError(f"{rows} rows cannot be {n_head} heads of even size")
    rest = tuple(tensor.shape[1:])
    return tensor.reshape(n_head, rows // n_head // 2, 2, *rest).transpose(1, 2).reshape(rows, *rest)


def needs_unpermute(name: str, arch: str) -> str | None:
    """``"q"`` or ``"k"`` when GGUF tensor ``name`` holds permuted rows, else None."""
    if arch not in PERMUTED_QK:
        return None
    match = _LAYER.fullmatch(name)
    if match and match.group(2) in ("attn_q", "attn_k"):
        return match.group(2)[-1]
    return None


def split_stacked(name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """One Hugging Face tensor per expert from a stacked GGUF expert tensor (``[E, rows, cols]``);
    any other tensor passes through, Qwen2-MoE's shared-expert gate as the ``[1, C]`` it is there
    (llama.cpp squeezes it to ``[C]``)."""
    match = _STACKED.fullmatch(name)
    if match is None:
        if name.endswith("mlp.shared_expert_gate.weight") and tensor.ndim == 1:
            tensor = tensor.unsqueeze(0)
        yield name, tensor
        return
    if tensor.ndim != 3:
        raise ValueError(f"{name}: stacked expert tensor has shape {tuple(tensor.shape)}, expected 3 dims")
    prefix, proj = match.groups()
    for expert in range(tensor.shape[0]):
        yield f"{prefix}.{expert}.{proj}.weight", tensor[expert]
