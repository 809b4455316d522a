"""The optional grammar backend: xgrammar (MLC's pushdown automaton with precomputed token masks).

Built from our tokenizer alone (``xgrammar_vocab.py``: its ``TokenizerInfo`` and token bytes).

Behaviour matches the llguidance backend: compact JSON unless whitespace is allowed
(``separators=(",", ":")``), extra properties allowed unless ``disable_additional_properties``
closes the objects, Lark grammars (``compile_lark``) and EBNF / GBNF ones (``::=`` rules,
``compile_grammar``), ``json_object`` as the schema ``{"type": "object"}``. Where xgrammar's JSON
handling falls short (keywords it would ignore, loosely checked formats, wrong masks for control
characters and surrogates) ``xgrammar_json.py`` refuses, rewrites or filters.

Differences handled here: xgrammar terminates only once it has accepted a stop token, so
``is_terminated`` also holds when the match is complete and the mask allows nothing but stop
tokens (one one-row mask fill, only in complete states); a terminated matcher cannot fill a mask,
so its row gets only the stop tokens. A JSON matcher's rows are ANDed with its text filter and
``accept`` refuses the same tokens.

Compiles are eager (every token mask precomputed: ~5-30 ms for an extraction schema on a 49k
vocabulary, ~0.5 s for a 64 KiB one); xgrammar cannot cancel one, so a compile that passes the
time limit is abandoned to finish on its daemon thread, and at most ``_COMPILE_SLOTS`` compiles
run at once. The batch fill (``BatchGrammarMatcher``) runs without the GIL.
"""

from __future__ import annotations

import json
import os
import re
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import xgrammar

from batchinfer.workers.structured.backend import (
    GrammarBackend,
    Matcher,
    StructuredOutputError,
    closed_objects,
)
from batchinfer.workers.structured.xgrammar_json import (
    JsonTextFilter,
    check_enforceable,
    json_text_filter,
    strict_formats,
)
from batchinfer.workers.structured.xgrammar_vocab import adds_prefix_space, token_tables, tokenizer_info
from batchinfer.workers.structured_params import StructuredOutputsParams

if TYPE_CHECKING:
    import torch

_COMPILE_SLOTS = 4  # compiles running at once, abandoned (timed-out) ones included
# xgrammar's C++ errors start "[17:11:21] /project/cpp/json_schema_converter.cc:5082: ".
_CPP_PREFIX = re.compile(r"^\s*\[[0-9:]+\]\s*\S+:\d+:\s*")


@dataclass(frozen=True)
class XGrammarCompiled:
    """A compiled grammar and, for JSON, its text filter."""

    grammar: xgrammar.CompiledGrammar
    json_filter: JsonTextFilter | None = None


class XGrammarMatcher(Matcher):
    """A wrapped ``xgrammar.GrammarMatcher`` (see the module docstring for termination)."""

    def __init__(self, backend: XGrammarBackend, compiled: XGrammarCompiled) -> None:
        self.backend = backend
        self.compiled = compiled
        self.xg = xgrammar.GrammarMatcher(compiled.grammar)
        self.filter = compiled.json_filter
        self._history: list[int] = []  # accepted tokens (kept for the JSON filter only)
        self._error: str | None = None
        self._terminal: bool | None = None  # "only stop tokens may follow", cached per state
        self._forced: list[int] | None = None  # forced_tokens() of this state, when known

    @property
    def after_ed(self) -> bool:
        """Whether the last accepted token ends with the byte 0xED (see ``JsonTextFilter``)."""
        return self.filter is not None and bool(self._history) and self._history[-1] in self.filter.ends_ed

    def accept(self, token_id: int) -> bool:
        if self._error is not None:
            return False
        f = self.filter
        refused = f is not None and (token_id in f.banned or (self.after_ed and token_id in f.continuations))
        if refused or not self.xg.accept_token(token_id):
            self._error = f"token {token_id} {self.backend.token_text(token_id)!r} is not allowed here"
            return False
        if f is not None:
            self._history.append(token_id)
        self._terminal = None
        # Taking the first forced token leaves the rest forced (the same text, already tokenized and
        # checked): the engine's jump-forward asks after every token, so this saves re-tokenizing.
        forced = self._forced
        self._forced = forced[1:] if forced and forced[0] == token_id and len(forced) > 1 else None
        return True

    def keep_words(self) -> np.ndarray | None:
        """The words this matcher's mask row is ANDed with (None: no filter)."""
        if self.filter is None:
            return None
        return self.filter.keep_after_ed if self.after_ed else self.filter.keep

    def rollback(self, num_tokens: int) -> None:
        if not num_tokens:
            return
        try:
            self.xg.rollback(num_tokens)
        except RuntimeError as e:
            raise RuntimeError(f"xgrammar could not roll back {num_tokens} tokens: "
                               f"{_clean(str(e))}") from None
        if self.filter is not None:
            del self._history[len(self._history) - num_tokens:]
        # A rejected token was never accepted, so the state rolled back to is a valid one.
        self._error = None
        self._terminal = None
        self._forced = None

    def validate(self, token_ids: Sequence[int]) -> int:
        if self._error is not None:
            return 0
        n = 0
        for token in token_ids:
            if not self.accept(token):
                self._error = None  # a rejected token changed no state (xgrammar's contract)
                break
            n += 1
        self.rollback(n)
        return n

    def forced_tokens(self) -> list[int]:
        if self._forced is None:
            self._forced = self.backend.forced_tokens(self)
        return list(self._forced)

    @property
    def is_terminated(self) -> bool:
        if self.xg.is_terminated():  # a stop token was accepted
            return True
        if self._terminal is None:
            self._terminal = self.xg.is_completed() and self.backend.only_stop_tokens(self)
        return self._terminal

    @property
    def is_accepting(self) -> bool:
        return bool(self.xg.is_terminated() or self.xg.is_completed())

    @property
    def error(self) -> str | None:
        return self._error


class XGrammarBackend(GrammarBackend):
    """xgrammar bound to one tokenizer (see :class:`GrammarBackend` and the module docstring)."""

    name = "xgrammar"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.stop_token_ids = [i for i in self.eos_token_ids if 0 <= i < self.vocab_size]
        self._prefix_space = adds_prefix_space(self.tokenizer.backend)
        self.info = tokenizer_info(self.tokenizer.backend, self.vocab_size, self.stop_token_ids,
                                   self._prefix_space)
        threads = self.num_threads or max(1, (os.cpu_count() or 2) // 2)
        # No xgrammar cache: the base class's LRU is the one cache (bounded, and it counts compiles).
        self.compiler = xgrammar.GrammarCompiler(self.info, max_threads=max(1, os.cpu_count() or 1),
                                                 cache_enabled=False)
        self.batch = xgrammar.BatchGrammarMatcher(threads)  # fills rows in parallel, GIL released
        self._slots = threading.BoundedSemaphore(_COMPILE_SLOTS)
        # token id -> its bytes (b"" for special ids), proper prefixes of them, the longest's length
        self._tables: tuple[list[bytes], frozenset[bytes], int] | None = None
        self._filters: dict[bool, JsonTextFilter] = {}
        self._cols: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # id(keep words) -> (them, columns)

    # -- compiling ------------------------------------------------------------------------------

    def _compile(self, params: StructuredOutputsParams) -> XGrammarCompiled:
        kind, spec = params.kind, params.spec
        build: Callable[[], xgrammar.CompiledGrammar]
        if kind in ("json", "json_object"):
            schema: Any = {"type": "object"} if kind == "json_object" else spec
            if params.disable_additional_properties:
                schema = closed_objects(schema)
            check_enforceable(schema)
            schema = strict_formats(schema)
            text = json.dumps(schema)
            any_ws = not params.disable_any_whitespace
            # strict_mode=False: extra properties follow the schema (allowed unless closed), as in
            # llguidance; compact separators as llguidance writes them.
            build = lambda: self.compiler.compile_json_schema(  # noqa: E731
                text, any_whitespace=any_ws, separators=None if any_ws else (",", ":"), strict_mode=False)
        elif kind == "regex":
            build = lambda: self.compiler.compile_regex(spec)  # noqa: E731
        elif kind == "choice":
            ebnf = "root ::= " + " | ".join(ebnf_string(c) for c in spec)
            build = lambda: self.compiler.compile_grammar(ebnf)  # noqa: E731
        elif "::=" in spec:  # EBNF / GBNF (llama.cpp, xgrammar), root rule "root"
            build = lambda: self.compiler.compile_grammar(spec)  # noqa: E731
        else:  # Lark, with a "start" rule
            build = lambda: self.compiler.compile_lark(spec)  # noqa: E731
        grammar = self._within_time_limit(kind, build)
        if kind not in ("json", "json_object"):
            return XGrammarCompiled(grammar)
        compiled = XGrammarCompiled(grammar, self.json_filter(not params.disable_any_whitespace))
        if self.only_stop_tokens(self.matcher(compiled)):
            # e.g. "anyOf": []: xgrammar compiles it to a grammar that only stops (llguidance: an error).
            # A JSON value is never empty, so the schema matches nothing.
            raise StructuredOutputError(f"{kind}: the schema matches no value")
        return compiled

    def json_filter(self, whitespace: bool) -> JsonTextFilter:
        """What JSON matchers refuse beyond xgrammar's masks (``xgrammar_json.json_text_filter``),
        built once per whitespace setting."""
        key = bool(whitespace)
        if key not in self._filters:
            self._filters[key] = json_text_filter(self._token_tables()[0], self.vocab_size, key)
        return self._filters[key]

    def _columns(self, keep: np.ndarray) -> np.ndarray:
        """int64 [C]: the words ``keep`` changes (ANDing only those is ~10x cheaper than whole rows)."""
        cols = self._cols.get(id(keep))
        if cols is None or cols[0] is not keep:
            cols = self._cols[id(keep)] = (keep, np.flatnonzero(keep != -1))
        return cols[1]

    def _within_time_limit(self, kind: str, build: Callable[[], xgrammar.CompiledGrammar]
                           ) -> xgrammar.CompiledGrammar:
        """Run ``build`` on a daemon thread and wait for it at most the compile time limit.

        xgrammar releases the GIL while compiling (the wait returns on time) but cannot stop a
        compile: one past the limit finishes in the background, holding one of the
        ``_COMPILE_SLOTS``; a daemon thread does not hold up the process's exit."""
        limit = self.limits.compile_timeout_s
        too_slow = StructuredOutputError(f"{kind}: compiling took longer than the limit of {limit:g} s")
        if not self._slots.acquire(timeout=limit):  # every slot held by a slow compile
            raise too_slow
        done = threading.Event()
        box: dict[str, Any] = {}

        def run() -> None:
            try:
                box["compiled"] = build()
            except Exception as e:  # noqa: BLE001 - reported to the waiting caller
                box["error"] = e
            finally:
                self._slots.release()
                done.set()

        threading.Thread(target=run, name="xgrammar-compile", daemon=True).start()
        if not done.wait(limit):
            raise too_slow
        if "error" in box:
            raise StructuredOutputError(f"{kind}: {_clean(str(box['error']))}") from None
        return box["compiled"]

    def matcher(self, compiled: XGrammarCompiled) -> XGrammarMatcher:
        return XGrammarMatcher(self, compiled)

    # -- masks ----------------------------------------------------------------------------------

    def fill_bitmask(self, matchers: Sequence[tuple[Matcher, int]], bitmask: torch.Tensor) -> None:
        if not matchers:
            return
        self.check_bitmask(matchers, bitmask)
        live: list[xgrammar.GrammarMatcher] = []
        rows: list[int] = []
        filtered: dict[int, list[int]] = {}  # id(keep words) -> the rows to AND with them
        keeps: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # id -> (keep words, their columns)
        for m, row in matchers:
            xm: XGrammarMatcher = m  # type: ignore[assignment]
            if xm.xg.is_terminated():  # xgrammar refuses to fill after a stop token: stop tokens only
                self._stop_only_row(bitmask, row)
                continue
            live.append(xm.xg)
            rows.append(row)
            keep = xm.keep_words()
            if keep is not None:
                filtered.setdefault(id(keep), []).append(row)
                if id(keep) not in keeps:
                    keeps[id(keep)] = (keep, self._columns(keep))
        if live:
            self.batch.batch_fill_next_token_bitmask(live, bitmask, rows)
        words = bitmask.numpy()  # a view
        for k, keep_rows in filtered.items():
            keep, cols = keeps[k]
            words[np.ix_(np.asarray(keep_rows), cols)] &= keep[cols]

    def _stop_only_row(self, bitmask: torch.Tensor, row: int) -> None:
        words = bitmask[row].numpy()  # a view
        words[:] = 0
        for t in self.stop_token_ids:
            words[t // 32] |= np.int32(-(2**31) if t % 32 == 31 else 1 << (t % 32))

    def only_stop_tokens(self, m: XGrammarMatcher) -> bool:
        """Whether ``m``'s next-token mask allows stop tokens only (the grammar cannot go on)."""
        import torch

        mask = torch.empty((1, (self.vocab_size + 31) // 32), dtype=torch.int32)
        m.xg.fill_next_token_bitmask(mask, 0)
        words = mask[0].numpy().copy()
        keep = m.keep_words()
        if keep is not None:
            words &= keep
        for t in self.stop_token_ids:
            words[t // 32] &= ~np.int32(-(2**31) if t % 32 == 31 else 1 << (t % 32))
        return not words.any()

    # -- jump-forward ---------------------------------------------------------------------------

    def forced_tokens(self, m: XGrammarMatcher) -> list[int]:
        """The tokens of the text the grammar forces next, in the tokenizer's own tokenization
        (``find_jump_forward_string`` encoded by our tokenizer), keeping only a prefix that is safe:

        - tokens that end inside the forced text's longest suffix that some longer token starts
          with are dropped: the text after the forced one could merge with that suffix (the forced
          ``"na"`` may become ``"name"``), so the tokenizer's tokenization of the whole output may
          split there differently. This drops the last token when it could be extended, and keeps
          the closing ``"}`` of an object when no token starts with it;
        - each kept token must spell the forced bytes in order and be accepted by the matcher
          (accepted, then rolled back), so a tokenizer whose normalizer changes text (a prepended
          ``▁``) can only shorten the list, never force a token the grammar does not allow.

        (xgrammar's own ``find_jump_forward_tokens`` is a greedy longest-token split, not the
        tokenizer's tokenization, so it is not used.)"""
        xg = m.xg
        if m.error is not None or xg.is_terminated():
            return []
        text = xg.find_jump_forward_string()
        if not text:
            return []
        data = text.encode("utf-8")
        decoded, extendable, max_token_bytes = self._token_tables()
        safe_end = len(data)
        for start in range(max(0, len(data) - max_token_bytes), len(data)):
            if data[start:] in extendable:  # the longest such suffix: the earliest start
                safe_end = start
                break
        out: list[int] = []
        end = 0
        for t in self._encode_continuation(text, decoded):
            piece = decoded[t] if 0 <= t < len(decoded) else b""
            if not piece or end + len(piece) > safe_end or data[end:end + len(piece)] != piece:
                break
            if (m.filter is not None and t in m.filter.banned) or not xg.accept_token(t):
                break
            out.append(t)
            end += len(piece)
        if out:
            xg.rollback(len(out))
        return out

    def _encode_continuation(self, text: str, decoded: list[bytes]) -> list[int]:
        """``text``'s tokens as the continuation of an output. A tokenizer that prepends a space
        (SentencePiece's "▁") would spell the forced ``hi`` as `` hi``: encode ``"\n" + text``
        instead and drop the tokens of the (space and) newline, when they end on a token boundary."""
        encode = self.tokenizer.encode
        if not self._prefix_space:
            return encode(text, add_special_tokens=False)
        ids = encode("\n" + text, add_special_tokens=False)
        head = b""
        for k, t in enumerate(ids[:3]):
            head += decoded[t] if 0 <= t < len(decoded) else b""
            if head in (b"\n", b" \n"):
                return ids[k + 1:]
        return encode(text, add_special_tokens=False)  # the verification in forced_tokens trims it

    def _token_tables(self) -> tuple[list[bytes], frozenset[bytes], int]:
        """``xgrammar_vocab.token_tables``, built on first use."""
        if self._tables is None:
            self._tables = token_tables(self.info, self.stop_token_ids)
        return self._tables

    def token_text(self, token_id: int) -> str:
        """A token's text for error messages."""
        if not 0 <= token_id < self.vocab_size:
            return f"<id outside the vocabulary of {self.vocab_size}>"
        return self.tokenizer.backend.decode([token_id], skip_special_tokens=False)


def ebnf_string(text: str) -> str:
    """``text`` as an xgrammar EBNF string literal (quotes, backslashes and control characters
    escaped; other characters as they are)."""
    out = []
    for ch in text:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def _clean(message: str) -> str:
    """The first line of an xgrammar error, without its C++ time and source-file prefix."""
    lines = [ln for ln in message.strip().splitlines() if ln.strip()]
    return _CPP_PREFIX.sub("", lines[0]).strip() if lines else "the grammar is invalid"
