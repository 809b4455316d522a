"""A Hugging Face folder -> a GGUF file, the way llama.cpp's converter lays it out (tests, benches).

The inverse of the loader's GGUF path, for the architectures ``config.ARCHITECTURES`` maps (and
Mixtral, which llama.cpp writes as ``llama``): names (``names.py`` backwards), llama.cpp's q/k row
permutation for ``llama``, each layer's experts stacked into one ``[E, rows, cols]`` tensor, Phi-3's
fused qkv / gate_up kept and its LongRoPE factors as tensors, 2-D and 3-D weights quantized with
``gguf.quants.quantize`` (norms, biases, routers and other 1-D tensors stay F32, as llama.cpp
keeps them), the token list and merges of the folder's ``tokenizer.json``. Only types ``gguf``
can quantize can be written. A checkpoint a llama.cpp file cannot describe (a Gemma attention
scale off llama.cpp's rule, a RoPE type other than linear) is refused; the metadata keys llama.cpp
leaves out (Gemma 3's local RoPE base, its sliding pattern, Qwen-MoE's top-k renormalisation) are
written only when they differ from llama.cpp's fixed values, so a default checkpoint's file is the
converter's.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter, RopeScalingType
from gguf.quants import quantize
from safetensors.numpy import load_file

from batchinfer.workers.models.gguf.hf_config import (
    GEMMA3_LOCAL_ROPE_BASE,
    GEMMA3_SLIDING_PATTERN,
    gemma_query_scalar,
)
from batchinfer.workers.models.gguf.names import _GLOBAL_NAMES, PERMUTED_QK, has_norm_offset, layer_names

_ARCH = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
         "Qwen3ForCausalLM": "qwen3", "Gemma2ForCausalLM": "gemma2", "Gemma3ForCausalLM": "gemma3",
         "Phi3ForCausalLM": "phi3", "Qwen2MoeForCausalLM": "qwen2moe", "Qwen3MoeForCausalLM": "qwen3moe",
         "MixtralForCausalLM": "llama"}
_GGUF_NAMES = {hf: g for g, hf in _GLOBAL_NAMES.items()}
# One expert's tensor in a checkpoint (Mixtral's w1/w3/w2, Qwen's gate/up/down_proj).
_EXPERT = re.compile(r"model\.layers\.(\d+)\.(?:block_sparse_moe|mlp)\.experts\.(\d+)\.(\w+)\.weight")
_EXPERT_PROJ = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj",
                "gate_proj": "gate_proj", "up_proj": "up_proj", "down_proj": "down_proj"}
_WINDOWED = ("MistralForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM")  # sliding_window written
_F32_ALWAYS = ("ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight", "norm.weight")  # llama.cpp's rule


def write_gguf(model_dir: str | Path, dest: str | Path,
               qtype: GGMLQuantizationType = GGMLQuantizationType.F32) -> Path:
    """Write the single-file safetensors checkpoint in ``model_dir`` as GGUF file ``dest``."""
    model_dir, dest = Path(model_dir), Path(dest)
    cfg = json.loads((model_dir / "config.json").read_text())
    hf_arch = cfg["architectures"][0]
    arch = _ARCH[hf_arch]
    w = GGUFWriter(str(dest), arch)
    w.add_name(model_dir.name)
    _add_metadata(w, cfg, hf_arch, arch)
    _add_tokenizer(w, model_dir, cfg)
    for gname, x in _tensors(load_file(str(model_dir / "model.safetensors")), cfg, hf_arch, arch):
        block = GGML_QUANT_SIZES[qtype][0]
        if (qtype == GGMLQuantizationType.F32 or x.ndim < 2 or x.shape[-1] % block
                or gname.endswith(_F32_ALWAYS) or gname.startswith("rope_factors")):
            w.add_tensor(gname, x)
        else:
            data = quantize(x, qtype)
            w.add_tensor(gname, data, raw_dtype=None if data.dtype == np.float16 else qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dest


def _rope(cfg: dict, layer_type: str = "full_attention") -> dict[str, Any]:
    """The rope parameters of ``layer_type`` (5.x ``rope_parameters``, nested or not; 4.x keys)."""
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    if isinstance(params.get(layer_type), dict):
        params = dict(params[layer_type])
    params.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    return params


def _add_metadata(w: GGUFWriter, cfg: dict, hf_arch: str, arch: str) -> None:
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or hidden // heads
    rope = _rope(cfg)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg.get("max_position_embeddings", 2048))
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(float(rope["rope_theta"]))
    w.add_layer_norm_rms_eps(float(cfg.get("rms_norm_eps", 1e-6)))
    if hf_arch == "Phi3ForCausalLM":
        _add_phi3(w, cfg, rope)
        return
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    kind = rope.get("rope_type") or rope.get("type") or "default"
    if kind == "linear":
        w.add_rope_scaling_type(RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(float(rope["factor"]))
    elif kind != "default":
        raise ValueError(f"{hf_arch}: rope type {kind!r} is not written by this GGUF writer")
    if cfg.get("sliding_window") and hf_arch in _WINDOWED:
        w.add_sliding_window(int(cfg["sliding_window"]))
    if hf_arch in ("Gemma2ForCausalLM", "Gemma3ForCausalLM"):
        _check_gemma_scale(cfg, hf_arch)
    if arch == "gemma2":  # llama.cpp writes both caps (transformers' defaults when config.json omits them)
        w.add_float32(f"{arch}.attn_logit_softcapping", float(cfg.get("attn_logit_softcapping") or 50.0))
        w.add_float32(f"{arch}.final_logit_softcapping", float(cfg.get("final_logit_softcapping") or 30.0))
    if arch == "gemma3":
        _add_gemma3(w, cfg)
    experts = cfg.get("num_local_experts") or cfg.get("num_experts")
    if experts:
        _add_moe(w, cfg, hf_arch, int(experts))


def _check_gemma_scale(cfg: dict, hf_arch: str) -> None:
    scalar = cfg.get("query_pre_attn_scalar") or 256
    rule = gemma_query_scalar({**cfg, "head_dim": cfg.get("head_dim") or 256}, hf_arch)
    if float(scalar) != float(rule):
        raise ValueError(f"{hf_arch}: query_pre_attn_scalar {scalar} is not llama.cpp's rule ({rule}); "
                         "a GGUF file cannot carry it")


def _add_gemma3(w: GGUFWriter, cfg: dict) -> None:
    if cfg.get("final_logit_softcapping"):
        w.add_final_logit_softcapping(float(cfg["final_logit_softcapping"]))
    params = cfg.get("rope_parameters") or {}
    nested = params.get("sliding_attention")
    local: dict[str, Any] = nested if isinstance(nested, dict) else {}
    if (local.get("rope_type") or "default") != "default":
        raise ValueError(f"Gemma3ForCausalLM: scaled RoPE on sliding layers ({local['rope_type']}) "
                         "cannot be written to GGUF")
    theta = local.get("rope_theta") or cfg.get("rope_local_base_freq") or GEMMA3_LOCAL_ROPE_BASE
    if float(theta) != GEMMA3_LOCAL_ROPE_BASE:
        w.add_rope_freq_base_swa(float(theta))
    layers = cfg["num_hidden_layers"]
    default = [(i + 1) % GEMMA3_SLIDING_PATTERN != 0 for i in range(layers)]
    types = cfg.get("layer_types")
    sliding = [t == "sliding_attention" for t in types] if types else default
    if sliding != default:
        w.add_sliding_window_pattern(sliding)


def _add_phi3(w: GGUFWriter, cfg: dict, rope: dict) -> None:
    """llama.cpp's Phi3MiniModel: rotary dims, original context, window 0 = none, LongRoPE attn factor."""
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    partial = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    original = int(rope.get("original_max_position_embeddings") or cfg.get("original_max_position_embeddings")
                   or cfg.get("max_position_embeddings", 4096))
    w.add_rope_scaling_orig_ctx_len(original)
    w.add_rope_dimension_count(int(partial * hidden) // heads)
    w.add_sliding_window(int(cfg.get("sliding_window") or 0))
    if rope.get("long_factor"):
        scale = cfg["max_position_embeddings"] / original
        factor = math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0
        w.add_rope_scaling_attn_factors(factor)


def _add_moe(w: GGUFWriter, cfg: dict, hf_arch: str, experts: int) -> None:
    w.add_expert_count(experts)
    w.add_expert_used_count(int(cfg["num_experts_per_tok"]))
    if hf_arch == "MixtralForCausalLM":
        return
    w.add_expert_feed_forward_length(int(cfg["moe_intermediate_size"]))
    if cfg.get("shared_expert_intermediate_size"):
        w.add_expert_shared_feed_forward_length(int(cfg["shared_expert_intermediate_size"]))
    renormalise = bool(cfg.get("norm_topk_prob", False))
    if renormalise != (hf_arch == "Qwen3MoeForCausalLM"):  # llama.cpp's fixed choice per arch
        w.add_expert_weights_norm(renormalise)


def _tensors(tensors: dict[str, np.ndarray], cfg: dict, hf_arch: str,
             arch: str) -> Iterator[tuple[str, np.ndarray]]:
    """(GGUF name, values) in llama.cpp's layout: renamed, norms shifted, q/k permuted, experts stacked."""
    heads = cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or heads
    experts: dict[tuple[int, str], dict[int, np.ndarray]] = {}
    for name, x in tensors.items():
        x = x.astype(np.float32)
        match = _EXPERT.fullmatch(name)
        if match:
            layer, expert, proj = match.groups()
            experts.setdefault((int(layer), _EXPERT_PROJ[proj]), {})[int(expert)] = x
            continue
        if name.endswith("mlp.experts.gate_up_proj"):  # transformers 5's fused layout [E, 2I, C]
            half = x.shape[1] // 2
            yield _gguf_name(name.replace("gate_up_proj", "gate_proj.weight"), arch), x[:, :half]
            yield _gguf_name(name.replace("gate_up_proj", "up_proj.weight"), arch), x[:, half:]
            continue
        if name.endswith("mlp.experts.down_proj"):
            yield _gguf_name(name + ".weight", arch), x
            continue
        name = name.replace(".block_sparse_moe.gate.", ".mlp.gate.")  # Mixtral's router
        gname = _gguf_name(name, arch)
        if has_norm_offset(gname, arch):
            x = x + 1  # llama.cpp's Gemma converter stores the (1 + w) norm's scale
        if arch in ("gemma2", "gemma3") and gname == "output.weight":
            continue  # Gemma ties the head to the embedding; llama.cpp writes no output.weight
        if arch in PERMUTED_QK and gname.split(".")[-2] in ("attn_q", "attn_k"):
            x = _permute(x, heads if ".attn_q." in gname else kv_heads)
        if gname.endswith("ffn_gate_inp_shexp.weight"):
            x = x.reshape(-1)  # llama.cpp squeezes the [1, C] shared-expert gate
        yield gname, x
    for (layer, proj), by_expert in sorted(experts.items()):
        stacked = np.stack([by_expert[e] for e in sorted(by_expert)])  # [E, rows, cols]
        yield _gguf_name(f"model.layers.{layer}.mlp.experts.{proj}.weight", arch), stacked
    if hf_arch == "Phi3ForCausalLM":
        rope = _rope(cfg)
        for key in ("long", "short"):
            if rope.get(f"{key}_factor"):
                yield f"rope_factors_{key}.weight", np.asarray(rope[f"{key}_factor"], np.float32)


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
    if cfg.get("pad_token_id") is not None:  # llama.cpp's SpecialVocab writes it too
        w.add_pad_token_id(int(cfg["pad_token_id"]))
    eos = cfg.get("eos_token_id")
    if eos is not None:
        w.add_eos_token_id(int(eos[0] if isinstance(eos, list) else eos))
    gen = model_dir / "generation_config.json"
    ends = json.loads(gen.read_text()).get("eos_token_id") if gen.is_file() else None
    if isinstance(ends, list) and len(ends) > 1:
        w.add_eot_token_id(int(ends[1]))  # the end-of-turn token llama.cpp also stops on
