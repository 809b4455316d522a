"""Deterministic random Hugging Face checkpoints: ``--model tiny``, the tests and the benchmarks.

``make_tiny_model`` writes a complete model directory — config.json, safetensors weights (one
file or shards + index), generation_config.json, tokenizer.json, tokenizer_config.json with a
chat template — from a seed alone: nothing is downloaded and transformers is not needed (tests
check that transformers loads these directories and agrees with our decoder).

Weights are drawn with scales that keep activations O(1) and logits spread out, so greedy
decoding of a random model produces varied tokens instead of one token repeated.

The real demo models are found by ``batchinfer.workers.models.demo``.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

BOS, EOS, EOT, PAD = "<|begin_of_text|>", "<|end_of_text|>", "<|eot|>", "<|pad|>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>", "<|tool|>")
SPECIAL_TOKENS = (BOS, EOS, EOT, PAD, *ROLE_TOKENS)
NUM_BPE_TOKENS = 312  # 256 byte symbols + 56 merges; the special tokens follow (vocab 320)

# Roles become their role token, each turn ends with <|eot|>; unknown roles are an error.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant', 'tool'] %}"
    "{{ raise_exception('unknown role: ' + message['role']) }}"
    "{% endif %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] | trim + '<|eot|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)

# The merges come from BPE training on this fixed text, so common words become single tokens.
CORPUS = (
    "The quick brown fox jumps over the lazy dog. Hello world! The engine schedules requests "
    "in batches; each request has a prompt and the model generates tokens until it stops. "
    "There is the cache, the scheduler, the worker and the queue. Hello, hello, hello there."
)

_ARCHITECTURES: dict[str, dict[str, Any]] = {
    "LlamaForCausalLM": {"model_type": "llama", "rope_theta": 10000.0, "attention_bias": False,
                         "mlp_bias": False, "tie_word_embeddings": False},
    "MistralForCausalLM": {"model_type": "mistral", "rope_theta": 10000.0, "sliding_window": 48,
                           "tie_word_embeddings": False},
    "Qwen2ForCausalLM": {"model_type": "qwen2", "rope_theta": 1000000.0, "use_sliding_window": False,
                         "sliding_window": None, "max_window_layers": 2, "tie_word_embeddings": True},
    "Qwen3ForCausalLM": {"model_type": "qwen3", "rope_theta": 1000000.0, "head_dim": 32,
                         "attention_bias": False, "use_sliding_window": False, "sliding_window": None,
                         "max_window_layers": 2, "tie_word_embeddings": True},
}
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def make_tiny_model(
    path: str | Path,
    architecture: str = "LlamaForCausalLM",
    seed: int = 0,
    shards: int = 1,
    **config_overrides: Any,
) -> Path:
    """Write a random checkpoint of ``architecture`` into ``path`` (created) and return it.

    Defaults: hidden 64, 2 layers, 4 heads, 2 KV heads, intermediate 128, vocab 320 (the
    tokenizer's size), 512 positions, float32. ``config_overrides`` go into config.json
    (e.g. ``num_hidden_layers=4``, ``rope_scaling={...}``, ``torch_dtype="bfloat16"``, which is
    also the dtype the weights are saved in). ``shards > 1`` writes ``model-0000i-of-0000N``
    files and ``model.safetensors.index.json``. The same arguments give byte-identical files.
    """
    if architecture not in _ARCHITECTURES:
        raise ValueError(f"unknown architecture {architecture!r}; supported: {', '.join(_ARCHITECTURES)}")
    if shards < 1:
        raise ValueError(f"shards must be >= 1, got {shards}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    ids = {t: tokenizer.token_to_id(t) for t in SPECIAL_TOKENS}
    config: dict[str, Any] = {
        "architectures": [architecture],
        "vocab_size": tokenizer.get_vocab_size(),
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-5,
        "hidden_act": "silu",
        "initializer_range": 0.02,
        "torch_dtype": "float32",
        "bos_token_id": ids[BOS],
        "eos_token_id": ids[EOS],
        "pad_token_id": ids[PAD],
        "use_cache": True,
        **_ARCHITECTURES[architecture],
        **config_overrides,
    }
    if config["vocab_size"] < tokenizer.get_vocab_size():
        raise ValueError(f"vocab_size {config['vocab_size']} is smaller than the tokenizer's "
                         f"{tokenizer.get_vocab_size()} tokens")
    if config["torch_dtype"] not in _DTYPES:
        raise ValueError(f"torch_dtype {config['torch_dtype']!r} not in {', '.join(_DTYPES)}")
    tensors = random_weights(config, seed)
    write_weights(path, tensors, shards)
    write_json(path / "config.json", config)
    for name, data in tokenizer_files(config["max_position_embeddings"]).items():
        write_text(path / name, data.decode("utf-8"))
    return path


def tokenizer_files(model_max_length: int = 512) -> dict[str, bytes]:
    """tokenizer.json, tokenizer_config.json and generation_config.json of the tiny models, as bytes
    (what a worker registers in Redis for the scheduler)."""
    tokenizer = build_tokenizer()
    ids = {t: tokenizer.token_to_id(t) for t in SPECIAL_TOKENS}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS, "eos_token": EOS, "pad_token": PAD,
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    generation = {"bos_token_id": ids[BOS], "eos_token_id": [ids[EOS], ids[EOT]], "pad_token_id": ids[PAD]}
    return {
        "tokenizer.json": tokenizer.to_str(pretty=True).encode("utf-8"),
        "tokenizer_config.json": (json.dumps(config, indent=2) + "\n").encode("utf-8"),
        "generation_config.json": (json.dumps(generation, indent=2) + "\n").encode("utf-8"),
    }


def make_tiny_demo_model(path: str | Path, seed: int = 0) -> Path:
    """The model ``--model tiny`` serves: a tiny random Llama, a bit bigger than the test default
    (~0.9M params)."""
    return make_tiny_model(path, "LlamaForCausalLM", seed=seed, hidden_size=128, intermediate_size=384,
                           num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                           max_position_embeddings=2048)


def build_tokenizer():
    """The byte-level BPE tokenizer (a fresh ``tokenizers.Tokenizer``) shared by every tiny model."""
    from tokenizers import Tokenizer

    return Tokenizer.from_str(_tokenizer_json())


@functools.lru_cache(maxsize=1)
def _tokenizer_json() -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=NUM_BPE_TOKENS, min_frequency=1, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator([CORPUS], trainer)
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    bos = tokenizer.token_to_id(BOS)
    tokenizer.post_processor = processors.TemplateProcessing(  # Llama 3 style: prepend BOS
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos)]
    )
    return tokenizer.to_str(pretty=True)


def random_weights(config: dict[str, Any], seed: int) -> dict[str, torch.Tensor]:
    """Hugging Face-named tensors for ``config``, drawn from a generator seeded with ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    dtype = _DTYPES[config["torch_dtype"]]
    arch = config["architectures"][0]
    C, I, V = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    H, KVH = config["num_attention_heads"], config["num_key_value_heads"]
    D = config.get("head_dim") or C // H
    qkv_bias = arch == "Qwen2ForCausalLM" or config.get("attention_bias", False)
    o_bias = arch != "Qwen2ForCausalLM" and config.get("attention_bias", False)
    mlp_bias = config.get("mlp_bias", False)

    def normal(*shape: int, std: float) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * std).to(dtype)

    def norm_weight(dim: int) -> torch.Tensor:  # near 1, but not 1, so a misplaced norm shows
        return (1.0 + 0.2 * torch.randn(dim, generator=gen)).to(dtype)

    # Tied models read logits off the embedding: a small embedding (std 1/sqrt(C)) keeps each
    # token from predicting itself, and a final norm weight near 3 gives logits of std ~3.
    # o/down projections at gain 2 let the layers dominate the residual stream.
    tied = config.get("tie_word_embeddings", False)
    out = {"model.embed_tokens.weight": normal(V, C, std=C**-0.5 if tied else 1.0)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = norm_weight(C)
        # q/k larger than 1/sqrt(fan_in) so attention is peaked and position errors change outputs.
        for name, rows, std in (("q", H * D, 1.5), ("k", KVH * D, 1.5), ("v", KVH * D, 1.0)):
            out[p + f"self_attn.{name}_proj.weight"] = normal(rows, C, std=std / C**0.5)
            if qkv_bias:
                out[p + f"self_attn.{name}_proj.bias"] = normal(rows, std=0.2)
        out[p + "self_attn.o_proj.weight"] = normal(C, H * D, std=2.0 * (H * D) ** -0.5)
        if o_bias:
            out[p + "self_attn.o_proj.bias"] = normal(C, std=0.2)
        if arch == "Qwen3ForCausalLM":
            out[p + "self_attn.q_norm.weight"] = norm_weight(D)
            out[p + "self_attn.k_norm.weight"] = norm_weight(D)
        out[p + "post_attention_layernorm.weight"] = norm_weight(C)
        for name, shape in (("gate", (I, C)), ("up", (I, C)), ("down", (C, I))):
            gain = 2.0 if name == "down" else 1.0
            out[p + f"mlp.{name}_proj.weight"] = normal(*shape, std=gain * shape[1] ** -0.5)
            if mlp_bias:
                out[p + f"mlp.{name}_proj.bias"] = normal(shape[0], std=0.2)
    out["model.norm.weight"] = norm_weight(C) * (3 if tied else 1)
    if not tied:
        out["lm_head.weight"] = normal(V, C, std=3.0 / C**0.5)  # logits of std ~3: varied greedy picks
    return out


def write_weights(path: Path, tensors: dict[str, torch.Tensor], shards: int) -> None:
    for old in [*path.glob("model*.safetensors"), path / "model.safetensors.index.json"]:
        old.unlink(missing_ok=True)  # a previous layout (single vs sharded) must not linger
    if shards == 1:
        _save(tensors, path / "model.safetensors")
        return
    names = list(tensors)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    weight_map: dict[str, str] = {}
    per_shard = -(-len(names) // shards)  # ceil: every shard non-empty when len(names) >= shards
    for s in range(shards):
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[s * per_shard:(s + 1) * per_shard]}
        if not part:
            raise ValueError(f"shards={shards} is more than the {len(names)} tensors allow")
        _save(part, path / fname)
        weight_map.update(dict.fromkeys(part, fname))
    write_json(path / "model.safetensors.index.json",
                {"metadata": {"total_size": total}, "weight_map": weight_map})


def _save(tensors: dict[str, torch.Tensor], dest: Path) -> None:
    tmp = dest.with_name(dest.name + ".tmp")
    save_file({n: t.contiguous() for n, t in tensors.items()}, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, dest)


def write_json(dest: Path, data: dict[str, Any]) -> None:
    write_text(dest, json.dumps(data, indent=2) + "\n")


def write_text(dest: Path, text: str) -> None:
    """Write through a temporary file so a concurrent reader never sees a half-written file."""
    tmp = dest.with_name(dest.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, dest)
