"""Our tokenizer as xgrammar sees it: its ``TokenizerInfo`` and the bytes each token spells.

Built from the ``tokenizers`` backend alone (there is no transformers tokenizer object here): the
encoded vocabulary comes from its vocab, its type from the decoder (ByteLevel -> BYTE_LEVEL,
ByteFallback / Metaspace -> BYTE_FALLBACK, else RAW), its size is the model's (ids past the
tokenizer's are empty strings, which xgrammar treats as special: never allowed). Added tokens
marked special become empty strings too, so a JSON string can never contain ``<|eot|>`` spelled
as one token; added tokens that are plain text are re-encoded in the vocabulary's own alphabet so
xgrammar reads their true bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import xgrammar

from batchinfer.workers.text.token_bytes import _BYTE_LEVEL, _decoder_types

_BYTE_TO_LEVEL = {b: c for c, b in _BYTE_LEVEL.items()}  # byte -> its ByteLevel character


def tokenizer_info(backend: Any, vocab_size: int, stop_token_ids: list[int],
                   prefix_space: bool) -> xgrammar.TokenizerInfo:
    """The ``TokenizerInfo`` of a ``tokenizers`` backend for a model of ``vocab_size`` ids; the
    stop ids are the engine's EOS ids."""
    return xgrammar.TokenizerInfo(encoded_vocab(backend, vocab_size), vocab_type(backend),
                                  vocab_size=vocab_size, stop_token_ids=stop_token_ids or None,
                                  add_prefix_space=prefix_space)


def vocab_type(backend: Any) -> xgrammar.VocabType:
    """How the vocabulary spells bytes, from the tokenizer's decoder."""
    types = _decoder_types(backend)
    if "ByteLevel" in types:
        return xgrammar.VocabType.BYTE_LEVEL
    if "ByteFallback" in types or "Metaspace" in types:  # "▁" for a space, "<0x0A>" byte pieces
        return xgrammar.VocabType.BYTE_FALLBACK
    return xgrammar.VocabType.RAW


def encoded_vocab(backend: Any, vocab_size: int) -> list[str]:
    """Token id -> its vocabulary string, ``vocab_size`` long (the model's: ids past the tokenizer's
    are ""). Special added tokens are "" (never text); plain-text added tokens are spelled in the
    ByteLevel alphabet when the vocabulary uses it, so xgrammar decodes them to their own bytes."""
    out = [""] * vocab_size
    for token, i in backend.get_vocab(with_added_tokens=True).items():
        if 0 <= i < vocab_size:
            out[i] = token
    byte_level = vocab_type(backend) == xgrammar.VocabType.BYTE_LEVEL
    for i, added in backend.get_added_tokens_decoder().items():
        if not 0 <= i < vocab_size:
            continue
        if added.special:
            out[i] = ""
        elif byte_level:
            out[i] = "".join(_BYTE_TO_LEVEL[b] for b in added.content.encode("utf-8"))
    return out


def adds_prefix_space(backend: Any) -> bool:
    """Whether the tokenizer prepends a space to a text it encodes (SentencePiece's "▁a" for "a")."""
    try:
        tokens = backend.encode("a", add_special_tokens=False).tokens
    except Exception:  # noqa: BLE001 - a tokenizer that cannot encode "a" has no prefix to detect
        return False
    return bool(tokens) and tokens[0].startswith(("▁", "Ġ"))


def token_tables(info: xgrammar.TokenizerInfo,
                 stop_token_ids: Sequence[int]) -> tuple[list[bytes], frozenset[bytes], int]:
    """Each token's bytes (b"" for special and stop ids), every proper prefix of a token's bytes,
    and the longest token's length in bytes (~0.2 s for a 49k vocabulary)."""
    special = set(info.special_token_ids) | set(stop_token_ids)
    decoded = [b"" if i in special else bytes(b) for i, b in enumerate(info.decoded_vocab)]
    extendable = frozenset(b[:k] for b in decoded for k in range(1, len(b)))
    return decoded, extendable, max((len(b) for b in decoded), default=1)
