"""A Hugging Face folder -> a GGUF file, the way llama.cpp's converter lays it out (tests, benches).

The inverse of the loader's GGUF path, for the architectures ``config.ARCHITECTURES`` maps: names
(``names.py`` backwards), llama.cpp's q/k row permutation for ``llama``, 2-D weights quantized
with ``gguf.quants.quantize`` (norms and biases stay F32, as llama.cpp keeps them), the token list
and merges of the folder's ``tokenizer.json``. Only types ``gguf`` can quantize can be written.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize
from safetensors.numpy import load_file

from batchinfer.workers.models.gguf.names import _GLOBAL_NAMES, PERMUTED_QK, has_norm_offset, layer_names

_ARCH = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
         "Qwen3ForCausalLM": "qwen3", "Gemma2ForCausalLM": "gemma2"}
_GGUF_NAMES = {hf: g for g, hf in _GLOBAL_NAMES.items()}


def write_gguf(model_dir: str | Path, dest: str | Path,
               qtype: GGMLQuantizationType = GGMLQuantizationType.F32) -> Path:
    """Write the single-file safetensors checkpoint in ``model_dir`` as GGUF file ``dest``."""
    model_dir, dest = Path(model_dir), Path(dest)
    cfg = json.loads((model_dir / "config.json").read_text())
    arch = _ARCH[cfg["architectures"][0]]
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or hidden // heads
    w = GGUFWriter(str(dest), arch)
    w.add_name(model_dir.name)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg.get("max_position_embeddings", 2048))
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(float(cfg.get("rope_theta", 10000.0)))
    w.add_layer_norm_rms_eps(float(cfg.get("rms_norm_eps", 1e-6)))
    if cfg.get("sliding_window") and cfg["architectures"][0] in ("MistralForCausalLM", "Gemma2ForCausalLM"):
        w.add_sliding_window(int(cfg["sliding_window"]))
    if arch == "gemma2":  # llama.cpp writes both caps (transformers' defaults when config.json omits them)
        w.add_float32(f"{arch}.attn_logit_softcapping", float(cfg.get("attn_logit_softcapping") or 50.0))
        w.add_float32(f"{arch}.final_logit_softcapping", float(cfg.get("final_logit_softcapping") or 30.0))
    _add_tokenizer(w, model_dir, cfg)
    for name, x in load_file(str(model_dir / "model.safetensors")).items():
        gname = _gguf_name(name, arch)
        x = x.astype(np.float32)
        if has_norm_offset(gname, arch):
            x = x + 1  # llama.cpp's Gemma converter stores the (1 + w) norm's scale
        if arch == "gemma2" and gname == "output.weight":
            continue  # Gemma ties the head to the embedding; llama.cpp writes no output.weight
        if arch in PERMUTED_QK and gname.split(".")[-2] in ("attn_q", "attn_k"):
            x = _permute(x, heads if ".attn_q." in gname else kv_heads)
        block = GGML_QUANT_SIZES[qtype][0]
        if qtype == GGMLQuantizationType.F32 or x.ndim != 2 or x.shape[-1] % block:
            w.add_tensor(gname, x)
        else:
            data = quantize(x, qtype)
            w.add_tensor(gname, data, raw_dtype=None if data.dtype == np.float16 else qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dest


def _gguf_name(name: str, arch: str) -> str:
    if name in _GGUF_NAMES:
        return _GGUF_NAMES[name]
    table = {hf: g for g, hf in layer_names(arch).items()}
    match = re.fullmatch(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)", name)
    if match and match.group(2) in table:
        return f"blk.{match.group(1)}.{table[match.group(2)]}.{match.group(3)}"
    raise ValueError(f"{name}: no GGUF name for this tensor")


def _permute(x: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's ``LlamaModel.permute``: half-split RoPE rows -> interleaved."""
    return x.reshape(n_head, 2, x.shape[0] // n_head // 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)


def _add_tokenizer(w: GGUFWriter, model_dir: Path, cfg: dict) -> None:
    vocab = cfg["vocab_size"]
    tokens = [f"<t{i}>" for i in range(vocab)]
    merges: list[str] = []
    path = model_dir / "tokenizer.json"
    if path.is_file():
        tok = json.loads(path.read_text())
        for piece, i in tok["model"]["vocab"].items():
            tokens[i] = piece
        for added in tok.get("added_tokens", []):
            tokens[added["id"]] = added["content"]
        merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"].get("merges", [])]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    if merges:
        w.add_token_merges(merges)
    if cfg.get("bos_token_id") is not None:
        w.add_bos_token_id(int(cfg["bos_token_id"]))
    eos = cfg.get("eos_token_id")
    if eos is not None:
        w.add_eos_token_id(int(eos[0] if isinstance(eos, list) else eos))
    gen = model_dir / "generation_config.json"
    ends = json.loads(gen.read_text()).get("eos_token_id") if gen.is_file() else None
    if isinstance(ends, list) and len(ends) > 1:
        w.add_eot_token_id(int(ends[1]))  # the end-of-turn token llama.cpp also stops on
