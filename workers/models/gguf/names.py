"""GGUF tensor names -> the Hugging Face names the loader maps onto the decoder, and llama.cpp's
Q/K row permutation undone.

llama.cpp's ``convert_hf_to_gguf.py`` renames every tensor (``model.layers.3.self_attn.q_proj``
-> ``blk.3.attn_q``) and, for the ``llama`` architecture only, reorders the rows of q and k from
Hugging Face's half-split RoPE layout to GPT-J's interleaved one; ``unpermute_qk`` restores it
(transformers' ``LlamaTensorProcessor`` does the same). Architectures whose names differ add a
row to ``_ARCH_LAYER_NAMES``.
"""

from __future__ import annotations

import re

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
}
# Gemma 2 / 3 "sandwich" norms: llama.cpp's ffn_norm is the pre-feedforward norm there.
_GEMMA_LAYER_NAMES = {
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# Per-architecture overrides of _LAYER_NAMES.
_ARCH_LAYER_NAMES: dict[str, dict[str, str]] = {"gemma2": _GEMMA_LAYER_NAMES, "gemma3": _GEMMA_LAYER_NAMES}
# Architectures whose RMSNorm scales by (1 + w): llama.cpp stores w + 1 (transformers subtracts it back).
NORM_OFFSET = frozenset({"gemma2", "gemma3"})
# Architectures whose q/k rows llama.cpp permutes on conversion.
PERMUTED_QK = frozenset({"llama", "mistral"})
_LAYER = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def hf_name(name: str, arch: str) -> str:
    """The Hugging Face name of GGUF tensor ``name``; ``ValueError`` naming it when unknown."""
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
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
