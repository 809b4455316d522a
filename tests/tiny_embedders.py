"""Deterministic random sentence-transformers embedding folders (encoders and a decoder embedder)
for the embedding tests and bench/embed_cpu.py; the decoder factory is batchinfer.workers.models.tiny."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from batchinfer.workers.models.tiny import (
    CORPUS,
    EOS,
    build_tokenizer,
    make_tiny_model,
    write_json,
    write_text,
    write_weights,
)

# -- embedding models -----------------------------------------------------------------------------

EMBEDDING_KINDS = ("bert", "roberta", "xlm-roberta", "qwen3")
_ENCODERS = {"bert": ("BertModel", "bert"), "roberta": ("RobertaModel", "roberta"),
             "xlm-roberta": ("XLMRobertaModel", "xlm-roberta")}
_WORDPIECECORPUS = CORPUS + (
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
    write_text(path / "modules.json", json.dumps(modules, indent=2) + "\n")
    (path / "1_Pooling").mkdir(exist_ok=True)
    modes = {"cls_token": "cls", "mean_tokens": "mean", "max_tokens": "max", "mean_sqrt_len_tokens": "sqrt",
             "weightedmean_tokens": "weighted", "lasttoken": "lasttoken"}
    flags = {f"pooling_mode_{m}": kind_ == pooling for m, kind_ in modes.items()}
    write_json(path / "1_Pooling" / "config.json", {"word_embedding_dimension": 64, **flags})
    write_json(path / "sentence_bert_config.json", {"max_seq_length": 256, "do_lower_case": False})
    write_json(path / "config_sentence_transformers.json", {"similarity_fn_name": "cosine"})
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
        normalizer.normalize_str(_WORDPIECECORPUS))]
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
    write_weights(path, out, 1)
    write_json(path / "config.json", config)
    write_text(path / "tokenizer.json", tokenizer.to_str(pretty=True))
    tok_config = {"tokenizer_class": "BertTokenizer" if kind == "bert" else "PreTrainedTokenizerFast",
                  "do_lower_case": kind == "bert", "model_max_length": 512, **names}
    write_json(path / "tokenizer_config.json", tok_config)


def _tiny_decoder_embedder(path: Path, seed: int, overrides: dict[str, Any]) -> None:
    """A Qwen3-Embedding-shaped folder: ``Qwen3Model``, tensors without the ``model.`` prefix, no LM head."""
    from tokenizers import processors

    make_tiny_model(path, "Qwen3ForCausalLM", seed=seed, **overrides)
    config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    config["architectures"] = ["Qwen3Model"]
    write_json(path / "config.json", config)
    from safetensors.torch import load_file

    tensors = load_file(str(path / "model.safetensors"))
    write_weights(path, {n.removeprefix("model."): t for n, t in tensors.items()}, 1)
    tokenizer = build_tokenizer()  # the tiny BPE; EOS appended as Qwen3-Embedding's tokenizer does
    eos = tokenizer.token_to_id(EOS)
    tokenizer.post_processor = processors.TemplateProcessing(single=f"$A {EOS}", pair=f"$A {EOS} $B {EOS}",
                                                             special_tokens=[(EOS, eos)])
    write_text(path / "tokenizer.json", tokenizer.to_str(pretty=True))
