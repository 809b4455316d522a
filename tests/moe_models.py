"""Tiny random MoE checkpoints (Mixtral, Qwen2-MoE, Qwen3-MoE) written by transformers itself.

Shared by tests/test_moe.py and bench/moe_cpu.py (imported as ``moe_models``). The model comes from
transformers' own config class and ``save_pretrained`` (so the files have the Hub layout: one
tensor per expert), with weights redrawn from a seeded generator at scales that keep greedy
decoding varied (the rules of ``batchinfer.workers.models.tiny.random_weights``), plus the tiny
models' byte-level tokenizer files.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from batchinfer.workers.models.tiny import tokenizer_files

ARCHITECTURES = {  # architecture -> (config class name, architecture-specific config)
    "MixtralForCausalLM": ("MixtralConfig", {"num_local_experts": 4, "sliding_window": None}),
    "Qwen2MoeForCausalLM": ("Qwen2MoeConfig", {"num_experts": 4, "moe_intermediate_size": 48,
                                               "shared_expert_intermediate_size": 80, "norm_topk_prob": False,
                                               "decoder_sparse_step": 1, "use_sliding_window": False}),
    "Qwen3MoeForCausalLM": ("Qwen3MoeConfig", {"num_experts": 4, "moe_intermediate_size": 48, "head_dim": 16,
                                               "norm_topk_prob": True, "mlp_only_layers": [1],
                                               "use_sliding_window": False}),
}


def make_tiny_moe_model(path: str | Path, architecture: str = "MixtralForCausalLM", seed: int = 0,
                        **overrides: Any) -> Path:
    """Write a random ``architecture`` checkpoint (hidden 64, 2 layers, 4 experts, top-2) into ``path``."""
    import transformers

    cls_name, extra = ARCHITECTURES[architecture]
    files = tokenizer_files(512)
    config = getattr(transformers, cls_name)(**{
        "vocab_size": 320, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
        "num_experts_per_tok": 2, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
        "bos_token_id": 312, "eos_token_id": 313, "pad_token_id": 315, **extra, **overrides,
    })
    config.architectures = [architecture]
    model = getattr(transformers, architecture)(config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            p.copy_(_draw(name, p.shape, gen))
    path = Path(path)
    model.save_pretrained(path)
    for fname, data in files.items():
        (path / fname).write_bytes(data)
    return path


def _draw(name: str, shape: torch.Size, gen: torch.Generator) -> torch.Tensor:
    noise = torch.randn(*shape, generator=gen)
    fan_in = shape[-1]
    if name.endswith("bias"):
        return 0.2 * noise
    if "norm" in name:  # near 1 but not 1, so a misplaced norm shows
        return 1.0 + 0.2 * noise
    if "embed_tokens" in name:
        return noise
    if "lm_head" in name:
        return noise * 3.0 / fan_in**0.5  # logits of std ~3
    if "q_proj" in name or "k_proj" in name or name.endswith("mlp.gate.weight") or "router" in name:
        return noise * 1.5 / fan_in**0.5  # peaked attention; decisive (but not tied) routing
    if "o_proj" in name or "down_proj" in name:
        return noise * 2.0 / fan_in**0.5  # the layers dominate the residual stream
    return noise / fan_in**0.5
