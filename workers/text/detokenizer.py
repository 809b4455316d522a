"""Incremental detokenisation (prefix / read offsets, as vLLM and TGI do) and stop strings.

Decoding one token at a time is wrong in two ways: a byte-level token may hold only part of a
UTF-8 character (decoding it alone gives U+FFFD), and SentencePiece-style decoders drop or keep
a leading space depending on what comes before. So every step decodes a small window of recent
tokens twice — ``ids[prefix:read]`` (text already emitted) and ``ids[prefix:]`` — and emits the
difference, only once it no longer ends in an incomplete character. The window starts inside the
prompt so the first output token is decoded in context too.

The tokenizer is anything with ``decode(ids, skip_special_tokens=...) -> str``: our
``batchinfer.workers.text.tokenizer.Tokenizer`` or a bare ``tokenizers.Tokenizer``.

:func:`append_tokens` does ``append`` for many completions at once (the engine's step: one token
for each running completion): the same decodes, in two passes over the batch, straight on the
``tokenizers.Tokenizer`` a ``Tokenizer`` wraps, and all-or-nothing when a decode raises.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

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
        return self._read()

    def extend(self, token_ids: Sequence[int]) -> str:
        """Add several output tokens with one decode (a completion whose text nobody read while it
        ran); return the text they made final, as ``append`` would for the last of them."""
        if not token_ids:
            return ""
        self._ids.extend(token_ids)
        return self._read()

    def flush(self) -> str:
        """Emit pending text even if it ends in U+FFFD (the completion ended mid-character)."""
        if not self.has_pending:
            return ""
        window = self._decode(self._ids)
        return self._emit(window) if len(window) > len(self._prefix_text) else ""

    def truncate(self, length: int) -> None:
        """Cut the emitted text to ``length`` characters (a stop string ended the completion)."""
        self._text = self._text[:length]

    def _read(self) -> str:
        """Decode the window and emit its new text, unless it ends in an incomplete character."""
        window = self._decode(self._ids)
        if len(window) <= len(self._prefix_text) or window.endswith(REPLACEMENT_CHAR):
            return ""
        return self._emit(window)

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


BatchDecode = Callable[[list[list[int]], bool], list[str]]


def _batch_decoder(tokenizer: Any) -> BatchDecode:
    """Decode many id lists: one ``decode`` per list, of the bare ``tokenizers.Tokenizer`` when
    ``tokenizer`` wraps one (``backend``: no wrapper frame per call), else of ``tokenizer``.

    Not ``decode_batch``: it hands the lists to a rayon pool of one thread per core, which on a
    CPU worker competes with torch's threads; measured on a loaded 2-core machine (256 windows of
    3 tokens) it took 580 us of wall time against 350 us for this loop, and with parallelism off
    it saved only 10%.
    """
    backend = getattr(tokenizer, "backend", None)
    decode = backend.decode if backend is not None and callable(getattr(backend, "decode", None)) \
        else tokenizer.decode
    return lambda seqs, skip: [decode(ids, skip_special_tokens=skip) for ids in seqs]


def _decode_many(detoks: Sequence[IncrementalDetokenizer], windows: list[list[int]]) -> list[str]:
    """Decode ``windows[i]`` with ``detoks[i]``'s tokenizer and flags: one batched call per
    (tokenizer, skip_special_tokens) group, usually one in all; empty windows decode to ''."""
    out = [""] * len(windows)
    groups: dict[tuple[int, bool], list[int]] = {}
    for i, (d, ids) in enumerate(zip(detoks, windows, strict=True)):
        if ids:
            groups.setdefault((id(d._tokenizer), d._skip_special), []).append(i)
    for (_, skip), idx in groups.items():
        texts = _batch_decoder(detoks[idx[0]]._tokenizer)([windows[i] for i in idx], skip)
        for i, text in zip(idx, texts, strict=True):
            out[i] = text
    return out


def append_tokens(detoks: Sequence[IncrementalDetokenizer], token_ids: Sequence[int]) -> list[str]:
    """``[d.append(t) for d, t in zip(detoks, token_ids)]``, with the same results, in bulk.

    Each detokenizer at most once (distinct completions). Nothing changes until every decode
    succeeded: when a decode raises, every detokenizer is left as it was.
    """
    if len(detoks) != len(token_ids):
        raise ValueError(f"append_tokens: {len(detoks)} detokenizers for {len(token_ids)} tokens")
    windows = [[*d._ids, t] for d, t in zip(detoks, token_ids, strict=True)]
    texts = _decode_many(detoks, windows)
    emit = [j for j, (d, w) in enumerate(zip(detoks, texts, strict=True))
            if len(w) > len(d._prefix_text) and not w.endswith(REPLACEMENT_CHAR)]
    # The emitted windows' unread tokens become their next prefix (as _emit does).
    prefixes = [windows[j][detoks[j]._read_offset:] for j in emit]
    prefix_texts = _decode_many([detoks[j] for j in emit], prefixes)
    new = [""] * len(detoks)
    for d, ids in zip(detoks, windows, strict=True):
        d._ids = ids
    for j, ids, prefix_text in zip(emit, prefixes, prefix_texts, strict=True):
        d = detoks[j]
        new[j] = texts[j][len(d._prefix_text):]
        d._text += new[j]
        d._ids, d._read_offset, d._prefix_text = ids, len(ids), prefix_text
    return new


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
