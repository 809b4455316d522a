"""A GGUF file's tokenizer, rebuilt as the Hugging Face files the rest of the system reads.

A GGUF carries no tokenizer.json: llama.cpp stores the vocabulary, scores, token types, merges and
special ids as ``tokenizer.ggml.*`` metadata. ``tokenizer_files`` turns those back into
``tokenizer.json`` (built with the ``tokenizers`` library), ``tokenizer_config.json`` (special
tokens, ``add_bos_token``, the chat template) and ``generation_config.json`` (the EOS ids), as
bytes by file name: what ``Tokenizer.from_files`` reads and what a worker registers in Redis.

Two vocabulary types (``tokenizer.ggml.model``): ``gpt2`` (byte-level BPE) and ``llama``
(SentencePiece BPE with byte fallback). For ``gpt2`` the ``pre`` type picks how text is split
before BPE, which decides token ids: the splits are llama.cpp's (llama-vocab.cpp), written as the
Hugging Face pre-tokenizers of the models they come from. Anything else is a ``ValueError`` that
names the value and lists the supported ones.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

from batchinfer.workers.models.gguf.reader import GGUFFile, gguf_path

# llama.cpp's token types (gguf.TokenType)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# --- pre-tokenizer splits (byte-level vocabularies) -----------------------------------------------
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT4O_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
                r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
                r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_TEKKEN_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
                 r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
                 r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_DEEPSEEK_CODER_SPLITS = (r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", r"[一-龥ࠀ-一가-퟿]+", r"\p{N}")
_DEEPSEEK_V3_SPLITS = (r"\p{N}{1,3}", r"[一-龥぀-ゟ゠-ヿ]+",
                       r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
                       r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_BLOOM_SPLIT = r" ?[^(\s|.,!?…。，、।۔،)]+"


@dataclass(frozen=True)
class _Pre:
    """How one family of ``pre`` values splits text: regexes applied in turn (None: GPT-2's,
    inside ByteLevel), single digits first, and whether a word found whole in the vocabulary
    skips the merges (llama.cpp's ``ignore_merges``, HF's ``BPE(ignore_merges=True)``)."""

    splits: tuple[str, ...] | None = None
    digits: bool = False
    ignore_merges: bool = False
    add_bos: bool = False  # llama.cpp's default when the file has no add_bos_token


_GPT2 = _Pre()
_SMOLLM = _Pre(digits=True)  # StarCoder's: each digit alone, then GPT-2's split
_LLAMA3 = _Pre((_LLAMA3_SPLIT,), ignore_merges=True, add_bos=True)
_QWEN2 = _Pre((_QWEN2_SPLIT,))

# pre value -> split, following llama.cpp's llama_vocab::load (names that share a split share a line)
PRE_TYPES: dict[str, _Pre] = {
    **dict.fromkeys(("default", "gpt2", "gpt-2", "phi-2", "mpt", "olmo", "jais", "exaone4", "trillion",
                     "granite-docling", "mellum", "a.x-4.0", "gigachat", "jina-es", "jina-de",
                     "jina-v2-es", "jina-v2-de", "modern-bert"), _GPT2),
    **dict.fromkeys(("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone",
                     "minerva-7b"), _SMOLLM),
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0",
                     "lfm2", "jina-v5-nano"), _LLAMA3),
    **dict.fromkeys(("dbrx", "smaug-bpe", "glm4", "chatglm-bpe"), _Pre((_LLAMA3_SPLIT,))),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez", "stablelm2", "hunyuan"),
                    _QWEN2),
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), _Pre((_GPT4O_SPLIT,))),
    "tekken": _Pre((_TEKKEN_SPLIT,), ignore_merges=True, add_bos=True),
    "deepseek-coder": _Pre(_DEEPSEEK_CODER_SPLITS),
    "deepseek-v3": _Pre(_DEEPSEEK_V3_SPLITS),
    **dict.fromkeys(("bloom", "poro-chat", "gpt3-finnish"), _Pre((_BLOOM_SPLIT,))),
    "viking": _Pre((_BLOOM_SPLIT, r"\p{N}")),
}
MODEL_TYPES = ("gpt2", "llama")
# SentencePiece vocabularies whose tokenizer differs by architecture (transformers' GGUF builders)
_SPM_BY_ARCH = {"phi3": "phi3", "gemma": "gemma", "gemma2": "gemma", "gemma3": "gemma"}


def tokenizer_files(source: str | Path | GGUFFile) -> dict[str, bytes]:
    """tokenizer.json, tokenizer_config.json and generation_config.json of a GGUF file (or a folder
    holding one), as bytes by name. ``ValueError`` names what the metadata lacks or does not support.

    Built once per file version: a worker asks twice at start (its engine's tokenizer, then the
    files it registers), and a 49k-token vocabulary takes seconds to read and build."""
    if isinstance(source, GGUFFile):
        return _build(source)
    found = gguf_path(source)
    if found is None:
        raise FileNotFoundError(f"{source}: no .gguf file here")
    stat = found.stat()
    return dict(_cached(str(found.resolve()), stat.st_mtime_ns, stat.st_size))


@functools.lru_cache(maxsize=4)
def _cached(path: str, mtime_ns: int, size: int) -> dict[str, bytes]:
    return _build(GGUFFile(path))


def _build(gguf: GGUFFile) -> dict[str, bytes]:
    name = gguf.path.name
    get = gguf.get
    kind = get("tokenizer.ggml.model")
    if kind is None:
        raise ValueError(f"{name}: no tokenizer in the metadata (tokenizer.ggml.model is missing)")
    if kind not in MODEL_TYPES:
        raise ValueError(f"{name}: tokenizer.ggml.model {kind!r} is not supported; "
                         f"supported: {', '.join(MODEL_TYPES)}")
    tokens = [str(t) for t in _require(gguf, "tokenizer.ggml.tokens")]
    types = [int(t) for t in get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)]
    if len(types) != len(tokens):
        raise ValueError(f"{name}: tokenizer.ggml.token_type has {len(types)} entries for "
                         f"{len(tokens)} tokens")
    merges = _merges(name, get("tokenizer.ggml.merges"))
    if kind == "gpt2":
        pre_name = get("tokenizer.ggml.pre") or "default"
        pre = PRE_TYPES.get(pre_name)
        if pre is None:
            raise ValueError(f"{name}: tokenizer.ggml.pre {pre_name!r} is not supported; "
                             f"supported: {', '.join(sorted(PRE_TYPES))}")
        if merges is None:
            raise ValueError(f"{name}: a gpt2 (byte-level BPE) tokenizer needs tokenizer.ggml.merges")
        backend = _byte_level(tokens, types, merges, pre)
        add_bos_default = pre.add_bos
    else:
        scores = get("tokenizer.ggml.scores")
        if merges is None and scores is None:
            raise ValueError(f"{name}: a llama (SentencePiece) tokenizer needs tokenizer.ggml.scores "
                             "or tokenizer.ggml.merges")
        flavour = _SPM_BY_ARCH.get(str(get("general.architecture", "")), "llama")
        backend = _sentencepiece(tokens, types, merges, [float(s) for s in scores or []], flavour,
                                 bool(get("tokenizer.ggml.add_space_prefix", True)))
        add_bos_default = True  # llama.cpp adds BOS to a SentencePiece vocabulary that does not say

    def token(key: str) -> str | None:
        index = get(f"tokenizer.ggml.{key}")
        if index is None:
            return None
        if not 0 <= int(index) < len(tokens):
            raise ValueError(f"{name}: tokenizer.ggml.{key} {index} is outside the "
                             f"{len(tokens)}-token vocabulary")
        return tokens[int(index)]

    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("bos_token_id"), "eos_token": token("eos_token_id"),
        "unk_token": token("unknown_token_id"), "pad_token": token("padding_token_id"),
        "add_bos_token": bool(get("tokenizer.ggml.add_bos_token", add_bos_default)),
        "add_eos_token": bool(get("tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
    }
    context = get(f"{get('general.architecture', '')}.context_length")
    if context is not None:
        config["model_max_length"] = int(context)
    template = _chat_template(gguf)
    if template is not None:
        config["chat_template"] = template
    # every end-of-generation id the file names (llama.cpp stops at each of them)
    eos = [int(v) for key in ("eos_token_id", "eot_token_id", "eom_token_id")
           if (v := get(f"tokenizer.ggml.{key}")) is not None]
    generation = {k: v for k, v in (("bos_token_id", get("tokenizer.ggml.bos_token_id")),
                                    ("eos_token_id", list(dict.fromkeys(eos)) or None),
                                    ("pad_token_id", get("tokenizer.ggml.padding_token_id")))
                  if v is not None}
    return {
        "tokenizer.json": backend.to_str(pretty=False).encode("utf-8"),
        "tokenizer_config.json": (json.dumps(config, indent=2, ensure_ascii=False) + "\n").encode("utf-8"),
        "generation_config.json": (json.dumps(generation, indent=2) + "\n").encode("utf-8"),
    }


def _require(gguf: GGUFFile, key: str) -> Any:
    value = gguf.get(key)
    if value is None:
        raise ValueError(f"{gguf.path.name}: metadata key {key!r} is missing")
    return value


def _merges(name: str, raw: list[str] | None) -> list[tuple[str, str]] | None:
    if raw is None:
        return None
    out = []
    for i, merge in enumerate(raw):
        parts = str(merge).split(" ")
        if len(parts) != 2:
            raise ValueError(f"{name}: tokenizer.ggml.merges[{i}] {merge!r} is not two tokens "
                             "separated by one space")
        out.append((parts[0], parts[1]))
    return out


def _chat_template(gguf: GGUFFile) -> str | list[dict[str, str]] | None:
    """``tokenizer.chat_template``, plus named ones (``tokenizer.chat_template.<name>``) as the
    list form of tokenizer_config.json."""
    default = gguf.get("tokenizer.chat_template")
    names = gguf.get("tokenizer.chat_templates") or []
    named = [{"name": str(n), "template": str(t)} for n in names
             if (t := gguf.get(f"tokenizer.chat_template.{n}")) is not None]
    if not named:
        return None if default is None else str(default)
    if default is not None:
        named.insert(0, {"name": "default", "template": str(default)})
    return named


@functools.cache
def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (the alphabet byte-level vocabularies are spelled in)."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)}
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _added_tokens(tokens: list[str], types: list[int]) -> list[AddedToken]:
    """Control tokens become special added tokens, user-defined ones plain added tokens: both are
    matched whole in the raw text (as llama.cpp does) instead of being cut into pieces."""
    return [AddedToken(t, special=kind == CONTROL, normalized=False)
            for t, kind in zip(tokens, types, strict=True) if kind in (CONTROL, USER_DEFINED) and t]


def _vocab(tokens: list[str], spell=None, keep: set[int] | None = None) -> dict[str, int]:
    # a string listed twice keeps its last id, as llama.cpp's token_to_id map does
    return {(t if spell is None or (keep and i in keep) else spell(t)): i for i, t in enumerate(tokens)}


def _byte_level(tokens: list[str], types: list[int], merges: list[tuple[str, str]], pre: _Pre) -> Tokenizer:
    table = _bytes_to_unicode()
    alphabet = set(table.values())

    def spell(token: str) -> str:  # a token stored as raw text (not in the byte alphabet): respell it
        return token if set(token) <= alphabet else "".join(table[b] for b in token.encode("utf-8"))

    # added tokens keep their raw text as the vocabulary key, so that the added token finds its id
    keep = {i for i, kind in enumerate(types) if kind in (CONTROL, USER_DEFINED)}
    backend = Tokenizer(models.BPE(vocab=_vocab(tokens, spell, keep), merges=merges, dropout=None,
                                   continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False,
                                   byte_fallback=False, ignore_merges=pre.ignore_merges))
    steps: list[Any] = [pre_tokenizers.Digits(individual_digits=True)] if pre.digits else []
    if pre.splits is None:
        steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True))
    else:
        steps += [pre_tokenizers.Split(Regex(r), behavior="isolated", invert=False) for r in pre.splits]
        steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False))
    backend.pre_tokenizer = steps[0] if len(steps) == 1 else pre_tokenizers.Sequence(steps)
    backend.decoder = decoders.ByteLevel()
    _add(backend, tokens, types)
    return backend


def _sentencepiece(tokens: list[str], types: list[int], merges: list[tuple[str, str]] | None,
                   scores: list[float], flavour: str, add_space_prefix: bool) -> Tokenizer:
    """SentencePiece BPE as transformers' LlamaTokenizer builds it: ``▁`` for spaces (Metaspace),
    byte fallback to ``<0xNN>`` tokens, merges from the file or derived from the scores."""
    if flavour == "gemma":
        # Gemma files store runs of spaces as spaces, and their merge order is the token order
        tokens = ["▁" * len(t) if " " in t and not t.strip() else t for t in tokens]
        scores = [-float(i) for i in range(len(tokens))]
    if merges is None:
        if len(scores) != len(tokens):
            raise ValueError(f"tokenizer.ggml.scores has {len(scores)} entries for {len(tokens)} tokens")
        merges = _merges_from_scores(tokens, scores)
    unk = next((t for t, kind in zip(tokens, types, strict=True) if kind == UNKNOWN), None)
    backend = Tokenizer(models.BPE(vocab=_vocab(tokens), merges=merges, dropout=None, unk_token=unk,
                                   fuse_unk=True, byte_fallback=True))
    steps: list[Any] = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if flavour == "phi3":
        # Phi-3: the prefix space comes from a normalizer, which also marks spaces after a leading one
        backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    elif flavour == "gemma":
        backend.normalizer = normalizers.Replace(" ", "▁")
        backend.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous", invert=False)
        add_space_prefix = False
    else:
        backend.pre_tokenizer = pre_tokenizers.Metaspace(
            replacement="▁", prepend_scheme="first" if add_space_prefix else "never", split=False)
    if add_space_prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    backend.decoder = decoders.Sequence(steps)
    _add(backend, tokens, types)
    return backend


def _add(backend: Tokenizer, tokens: list[str], types: list[int]) -> None:
    added = _added_tokens(tokens, types)
    backend.add_special_tokens([t for t in added if t.special])
    backend.add_tokens([t for t in added if not t.special])


def _merges_from_scores(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """The merges a SentencePiece vocabulary implies: every split of a token into two tokens, best
    score first (transformers' ``generate_merges``, which its GGUF loader uses: same order, same ids)."""
    vocab = {t: i for i, t in enumerate(tokens)}
    found: list[tuple[str, str, float]] = []
    for token, score in dict(zip(tokens, scores, strict=True)).items():  # a repeated token once
        local = [(token[:k], token[k:], score) for k in range(1, len(token))
                 if token[:k] in vocab and token[k:] in vocab]
        found += sorted(local, key=lambda m: (vocab[m[0]], vocab[m[1]]))
    found.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in found]
