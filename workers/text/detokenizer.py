"""Incremental detokenisation (prefix / read offsets, as vLLM and TGI do) and stop strings.

Decoding one token at a time is wrong in two ways: a byte-level token may hold only part of a
UTF-8 character (decoding it alone gives U+FFFD), and SentencePiece-style decoders drop or keep
a leading space depending on what comes before. So every step decodes a small window of recent
tokens twice — ``ids[prefix:read]`` (text already emitted) and ``ids[prefix:]`` — and emits the
difference, only once it no longer ends in an incomplete character. The window starts inside the
prompt so the first output token is decoded in context too.

The tokenizer is anything with ``decode(ids, skip_special_tokens=...) -> str``: our
``batchinfer.workers.text.tokenizer.Tokenizer`` or a bare ``tokenizers.Tokenizer``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

# Prompt tokens decoded as context before the first output token (vLLM uses 5 as well).
PROMPT_CONTEXT_TOKENS = 5
REPLACEMENT_CHAR = "\ufffd"


class Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """One completion's text, grown one token at a time."""

    def __init__(self, tokenizer: Decoder, prompt_token_ids: Sequence[int], skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        # The decoding window: tokens whose text is already emitted (the prefix, up to
        # read_offset) followed by pending ones. Older tokens are dropped as the window slides.
        self._ids: list[int] = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self._read_offset = len(self._ids)
        self._prefix_text = self._decode(self._ids)
        self._text = ""

    @property
    def text(self) -> str:
        """All output text emitted so far."""
        return self._text

    @property
    def has_pending(self) -> bool:
        """True when appended tokens' text is not emitted yet (an incomplete character, a skipped token)."""
        return self._read_offset < len(self._ids)

    def append(self, token_id: int) -> str:
        """Add one output token; return the text it made final ('' while a character is incomplete)."""
        self._ids.append(token_id)
        window = self._decode(self._ids)
        if len(window) <= len(self._prefix_text) or window.endswith(REPLACEMENT_CHAR):
            return ""
        return self._emit(window)

    def flush(self) -> str:
        """Emit pending text even if it ends in U+FFFD (the completion ended mid-character)."""
        if not self.has_pending:
            return ""
        window = self._decode(self._ids)
        return self._emit(window) if len(window) > len(self._prefix_text) else ""

    def truncate(self, length: int) -> None:
        """Cut the emitted text to ``length`` characters (a stop string ended the completion)."""
        self._text = self._text[:length]

    def _emit(self, window: str) -> str:
        new = window[len(self._prefix_text):]
        self._text += new
        # The tokens just read become the next window's prefix (vLLM: prefix_offset = read_offset).
        del self._ids[: self._read_offset]
        self._read_offset = len(self._ids)
        self._prefix_text = self._decode(self._ids)
        return new

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special) if ids else ""


def find_stop_string(
    text: str, num_new_chars: int, stop: Sequence[str], include_stop_str: bool
) -> tuple[str, int] | None:
    """Find a stop string completed by the last ``num_new_chars`` characters of ``text``.

    Only matches that end inside the new characters count, so a stop string spanning tokens is
    caught exactly once, when its last character arrives. When several complete in the new
    characters, the one that completes first wins (then the one starting first), as if the text
    had arrived one character at a time. Returns ``(stop string, length to truncate text to)``:
    the match's start, or its end with ``include_stop_str``; ``None`` when nothing matched.
    """
    if num_new_chars <= 0:
        return None
    best: tuple[int, int, str] | None = None  # (end, start, stop string)
    for s in stop:
        start = text.find(s, max(0, len(text) - num_new_chars - len(s) + 1))
        if start != -1 and (best is None or (start + len(s), start) < best[:2]):
            best = (start + len(s), start, s)
    if best is None:
        return None
    end, start, s = best
    return s, end if include_stop_str else start
