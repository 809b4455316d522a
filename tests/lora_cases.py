"""Shared LoRA test helpers: tiny random base models, random PEFT adapters for them, and
transformers + PEFT greedy decoding as the reference the engine's tokens are compared with.

Adapters are made by PEFT itself (``get_peft_model`` + ``save_pretrained``), so their files are what
a real PEFT training run writes; only the values are random: PEFT initialises every B to zero (an
adapter that changes nothing), so each ``lora_A`` / ``lora_B`` is refilled from a seeded generator.
Import transformers / peft lazily: the repo root's ``kernels/`` folder shadows a package
transformers probes for, so these run from test files (or ``python -P``), never ``python -c``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from batchinfer.workers.models.tiny import make_tiny_model, random_weights, tokenizer_files

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PHI3_TARGETS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")  # Phi-3's checkpoint is fused
BASE_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Phi3ForCausalLM")
# Prompts of the tiny byte-level tokenizer's ids (< 312), varied lengths.
PROMPTS: list[list[int]] = [[1, 50, 99, 7, 200], [5, 5, 5, 130, 42, 17, 256, 300, 3],
                            [72, 101, 108, 108, 111], [310, 2]]


def make_base(path: str | Path, architecture: str = "LlamaForCausalLM", seed: int = 0,
              **config_overrides: Any) -> Path:
    """A tiny random base model (hidden 64, 2 layers, 4 heads, 2 KV heads, intermediate 128,
    float32) of ``architecture``: Llama / Mistral / Qwen2 / Qwen3 by ``make_tiny_model``, Phi-3 with
    fused ``qkv_proj`` / ``gate_up_proj`` tensors (its checkpoint layout) and plain RoPE."""
    if architecture == "Phi3ForCausalLM":
        return make_tiny_phi3(path, seed, **config_overrides)
    return make_tiny_model(path, architecture, seed=seed, **config_overrides)


def make_tiny_phi3(path: str | Path, seed: int = 0, **config_overrides: Any) -> Path:
    """A random Phi-3 checkpoint: the tiny Llama's weights, q/k/v and gate/up fused as Phi-3 stores
    them, the tiny tokenizer, a config.json written by hand in transformers' 4.x form."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config: dict[str, Any] = {
        "architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "vocab_size": 320,
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
        "original_max_position_embeddings": 512, "rope_theta": 10000.0, "rope_scaling": None,
        "rms_norm_eps": 1e-5, "hidden_act": "silu", "tie_word_embeddings": False,
        "sliding_window": None, "attention_dropout": 0.0, "resid_pdrop": 0.0, "embd_pdrop": 0.0,
        "bos_token_id": 312, "eos_token_id": 313, "pad_token_id": 315, "torch_dtype": "float32",
        **config_overrides,
    }
    tensors = random_weights({**config, "architectures": ["LlamaForCausalLM"]}, seed)
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors[p + "self_attn.qkv_proj.weight"] = torch.cat(
            [tensors.pop(p + f"self_attn.{n}_proj.weight") for n in "qkv"])  # [q + 2 kv, C]
        tensors[p + "mlp.gate_up_proj.weight"] = torch.cat(
            [tensors.pop(p + f"mlp.{n}_proj.weight") for n in ("gate", "up")])  # [2 I, C]
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    for name, data in tokenizer_files(config["max_position_embeddings"]).items():
        (path / name).write_bytes(data)
    return path


def load_hf(base_dir: str | Path):
    """transformers' float32 model of a base folder, in eval mode."""
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32).eval()


def make_peft_adapter(
    base_dir: str | Path,
    out_dir: str | Path,
    *,
    r: int = 8,
    alpha: int = 16,
    targets: Sequence[str] = ALL_TARGETS,
    rslora: bool = False,
    seed: int = 0,
    rank_pattern: Mapping[str, int] | None = None,
    alpha_pattern: Mapping[str, float] | None = None,
    scale: float = 1.0,
    **lora_config: Any,
) -> Path:
    """Write a random PEFT LoRA adapter for the base model in ``base_dir`` into ``out_dir`` (created)
    and return ``out_dir``; ``lora_config`` goes into ``LoraConfig`` as is (e.g. ``layers_to_transform``).

    Values: A ~ N(0, 1 / in_features), B ~ N(0, (0.25 * scale)^2 / r) (std ~0.1 at r 8, hidden 64),
    so B A x has about ``0.25 * scale`` of x's per-channel size whatever the shapes, times the
    module's scaling: on the tiny models that changes most greedy tokens (checked by
    tests/test_lora_adapter.py), and stays tame in float32. The same arguments give the same tensors.
    """
    from peft import LoraConfig, get_peft_model

    model = load_hf(base_dir)
    config = LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets), use_rslora=rslora,
                        rank_pattern=dict(rank_pattern or {}), alpha_pattern=dict(alpha_pattern or {}),
                        lora_dropout=0.0, bias="none", **lora_config)
    peft_model = get_peft_model(model, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(peft_model.named_parameters()):
            if ".lora_A." in name:  # [r, in]
                param.copy_(torch.randn(param.shape, generator=gen) * param.shape[1] ** -0.5)
            elif ".lora_B." in name:  # [out, r]
                param.copy_(torch.randn(param.shape, generator=gen) * (0.25 * scale) * param.shape[1] ** -0.5)
    out_dir = Path(out_dir)
    peft_model.save_pretrained(str(out_dir))
    return out_dir


def peft_tensors(adapter_dir: str | Path) -> dict[str, torch.Tensor]:
    """The tensors of an adapter folder, as PEFT saved them (keys ``base_model.model....lora_A.weight``)."""
    from safetensors.torch import load_file

    return load_file(str(Path(adapter_dir) / "adapter_model.safetensors"))


def peft_lora_modules(base_dir: str | Path, adapter_dir: str | Path) -> dict[str, Any]:
    """PEFT's own view of a saved adapter, loaded by ``PeftModel.from_pretrained``: module name in the
    base model (``model.layers.0.self_attn.q_proj``) -> its ``peft.tuners.lora.Linear``
    (``.lora_A["default"].weight`` [r, in], ``.lora_B["default"].weight`` [out, r],
    ``.scaling["default"]``, ``.r["default"]``, ``.base_layer``)."""
    from peft import PeftModel
    from peft.tuners.lora import LoraLayer

    model = PeftModel.from_pretrained(load_hf(base_dir), str(adapter_dir)).eval()
    return {name: module for name, module in model.get_base_model().named_modules()
            if isinstance(module, LoraLayer)}


def peft_greedy(base_dir: str | Path, adapter_dir: str | Path | None, prompt_ids: Sequence[Sequence[int]],
                max_tokens: int) -> list[list[int]]:
    """transformers (+ PEFT when ``adapter_dir`` is given) greedy completions of each prompt, in float32.

    EOS convention: EOS never stops or alters decoding (``eos_token_id=None``): exactly
    ``max_tokens`` tokens per prompt, EOS ids included if they are the argmax. Compare with the
    engine's ``SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)``.
    Each prompt runs alone (no padding), as tests/test_llm_vs_transformers.py's ``hf_greedy``.
    """
    model = load_hf(base_dir)
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter_dir)).eval()
    outs = []
    with torch.no_grad():
        for prompt in prompt_ids:
            ids = torch.tensor([list(prompt)])
            seq = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                 max_new_tokens=max_tokens, min_new_tokens=0, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)
            outs.append(seq[0, ids.shape[1]:].tolist())
    return outs


def edit_adapter_config(adapter_dir: str | Path, **changes: Any) -> Path:
    """Rewrite fields of an adapter's adapter_config.json (a broken adapter for a refusal test)."""
    path = Path(adapter_dir) / "adapter_config.json"
    config = json.loads(path.read_text(encoding="utf-8"))
    config.update(changes)
    path.write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return Path(adapter_dir)


def edit_adapter_tensors(adapter_dir: str | Path, tensors: dict[str, torch.Tensor | None]) -> Path:
    """Replace (a tensor) or delete (``None``) tensors of an adapter's adapter_model.safetensors."""
    current = peft_tensors(adapter_dir)
    for key, tensor in tensors.items():
        if tensor is None:
            current.pop(key)
        else:
            current[key] = tensor
    save_file(current, str(Path(adapter_dir) / "adapter_model.safetensors"), metadata={"format": "pt"})
    return Path(adapter_dir)
