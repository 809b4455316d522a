"""Single tokens as text and bytes: what logprobs report for each token (vLLM's ``decoded_token``,
OpenAI's ``token`` and ``bytes``).

A token decoded alone is its ``decoded_token`` (special tokens kept). Its bytes are the UTF-8 of
that text, except where the text cannot hold them: a byte-level BPE token (GPT-2, Llama 3, Qwen)
or a SentencePiece byte-fallback token (``<0xE2>``) may be part of a UTF-8 character, which decodes
to U+FFFD; there the token's raw bytes are given, as OpenAI does. Results are cached per token id
(at most the vocabulary), so a request asking for logprobs costs a dict lookup per token after the
first sight of each token.
"""

from __future__ import annotations

import json
import re
from typing import Any

import tokenizers

_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's table inverted: the printable character ByteLevel stands in for each byte -> the byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return {c: b for b, c in chars.items()}


_BYTE_LEVEL = _byte_level_decoder()


def _decoder_types(backend: tokenizers.Tokenizer) -> set[str]:
    """The ``type`` of the tokenizer's decoder and of every decoder nested in it (a Sequence)."""
    decoder = backend.decoder
    if decoder is None:
        return set()
    types: set[str] = set()

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if isinstance(node.get("type"), str):
                types.add(node["type"])
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(json.loads(decoder.__getstate__()))
    return types


class TokenDecoder:
    """``decode(token_id) -> (text, bytes)`` of one token, cached; see the module docstring."""

    def __init__(self, backend: tokenizers.Tokenizer) -> None:
        self._backend = backend
        types = _decoder_types(backend)
        self._byte_level = "ByteLevel" in types
        self._byte_fallback = "ByteFallback" in types
        self._added = set(backend.get_added_tokens_decoder())
        self._cache: dict[int, tuple[str, bytes]] = {}

    def decode(self, token_id: int) -> tuple[str, bytes]:
        """The token decoded alone (special tokens kept) and its bytes."""
        hit = self._cache.get(token_id)
        if hit is None:
            text = self._backend.decode([token_id], skip_special_tokens=False)
            hit = self._cache[token_id] = (text, self._raw_bytes(token_id) or text.encode("utf-8"))
        return hit

    def _raw_bytes(self, token_id: int) -> bytes | None:
        """The token's own bytes where the vocabulary spells them (byte-level or byte fallback)."""
        if token_id in self._added:  # added tokens are plain text, whatever the decoder
            return None
        piece = self._backend.id_to_token(token_id)
        if piece is None:
            return None
        if self._byte_level:
            try:
                return bytes(_BYTE_LEVEL[c] for c in piece)
            except KeyError:  # not a byte-level piece after all
                return None
        if self._byte_fallback and (m := _BYTE_FALLBACK.fullmatch(piece)):
            return bytes([int(m.group(1), 16)])
        return None
