"""The default grammar backend: llguidance (Microsoft's Rust Earley parser + token trie).

Why it is the default: it has no dependencies, it compiles a JSON schema lazily (microseconds to a
few milliseconds, so a million rows with a thousand schemas cost nothing up front), and its batch
mask fill runs on its own thread pool without the GIL. Its matchers never raise for a bad grammar or
token: they enter an error state, which this wrapper turns into ``StructuredOutputError`` (compile)
or ``Matcher.error`` (generation).
"""

from __future__ import annotations

import concurrent.futures
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import llguidance
from llguidance.gbnf_to_lark import gbnf_to_lark

from batchinfer.workers.structured.backend import (
    GrammarBackend,
    Matcher,
    StructuredOutputError,
    closed_objects,
)
from batchinfer.workers.structured_params import StructuredOutputsParams

if TYPE_CHECKING:
    import torch
    from llguidance._lib import JsonCompileOptions  # a TypedDict of the stub only

# Rust's regex crate accepts a backslash before any ASCII punctuation; escaping exactly the
# metacharacters keeps choice strings literal.
_REGEX_META = re.compile(r"([\\.+*?()|\[\]{}^$#&\-~])")


class LLGuidanceMatcher(Matcher):
    """A wrapped ``llguidance.LLMatcher``."""

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self.ll = matcher
        self._uncounted = 0  # tokens (EOS) accepted after the matcher stopped: llguidance keeps no record

    def accept(self, token_id: int) -> bool:
        stopped = self.ll.is_stopped()
        accepted = bool(self.ll.consume_token(token_id))
        if accepted and stopped:
            self._uncounted += 1
        return accepted

    def rollback(self, num_tokens: int) -> None:
        # Every accepted token counts, EOS after the end included (as xgrammar counts it).
        skip = min(num_tokens, self._uncounted)
        self._uncounted -= skip
        num_tokens -= skip
        if num_tokens and not self.ll.rollback(num_tokens):
            raise RuntimeError(f"llguidance could not roll back {num_tokens} tokens: {self.ll.get_error()}")

    def validate(self, token_ids: Sequence[int]) -> int:
        if not token_ids or self.ll.is_error():
            return 0
        return int(self.ll.validate_tokens(list(token_ids)))

    def forced_tokens(self) -> list[int]:
        return list(self.ll.compute_ff_tokens())

    @property
    def is_terminated(self) -> bool:
        # llguidance reports an errored matcher as stopped too: that is a failure, not an end.
        return bool(self.ll.is_stopped()) and not self.ll.is_error()

    @property
    def is_accepting(self) -> bool:
        return bool(self.ll.is_accepting())

    @property
    def error(self) -> str | None:
        if not self.ll.is_error():
            return None
        # The first line says what failed; the parser-state dump that follows is noise in an error row.
        return (self.ll.get_error() or "").strip().split("\n", 1)[0] or "the matcher failed"


class LLGuidanceBackend(GrammarBackend):
    """llguidance bound to one tokenizer (see :class:`GrammarBackend`)."""

    name = "llguidance"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        eos = self.eos_token_ids or None
        self.ll_tokenizer = llguidance.LLTokenizer(self.tokenizer.backend.to_str(), n_vocab=self.vocab_size,
                                                   eos_token=eos, slices=_slices())
        self.executor = llguidance.LLExecutor(self.num_threads)
        # The lexer's fuel from our limits; llguidance's per-step bounds (step_lexer_fuel 200k,
        # step_max_items 50k, max_items_in_row 2000) stay its defaults. A matcher over a limit
        # enters its error state: a compile error, or the request's invalid_request mid-decode.
        self.parser_limits = llguidance.LLParserLimits(initial_lexer_fuel=self.limits.lexer_fuel)
        self._compiler = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="grammar-compile")

    def grammar_text(self, params: StructuredOutputsParams) -> str:
        """The llguidance grammar (its JSON form) for ``params``."""
        kind, spec = params.kind, params.spec
        if kind in ("json", "json_object"):
            schema: Any = {"type": "object"} if kind == "json_object" else spec
            if params.disable_additional_properties:
                schema = closed_objects(schema)
            options: JsonCompileOptions = {"whitespace_flexible": not params.disable_any_whitespace}
            try:
                return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)
            except (ValueError, TypeError) as e:
                raise StructuredOutputError(f"json: {e}") from None
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(spec)
        if kind == "choice":
            alternatives = "|".join(_REGEX_META.sub(r"\\\1", c) for c in spec)
            return llguidance.LLMatcher.grammar_from_regex(alternatives)
        lark = spec
        if "::=" in spec:  # EBNF / GBNF (llama.cpp, xgrammar) rather than Lark
            try:
                lark = gbnf_to_lark(spec)
            except Exception as e:  # noqa: BLE001 - its parser raises plain exceptions
                raise StructuredOutputError(f"grammar: not a valid EBNF grammar: {e}") from None
        return llguidance.LLMatcher.grammar_from_lark(lark)

    def _compile(self, params: StructuredOutputsParams) -> llguidance.LLMatcher:
        grammar = self.grammar_text(params)
        # The constructor compiles (with the GIL dropped); a worker thread lets a slow compile be
        # abandoned at the time limit. llguidance's own fuel limits end it soon after.
        future = self._compiler.submit(llguidance.LLMatcher, self.ll_tokenizer, grammar, log_level=0,
                                       limits=self.parser_limits)
        try:
            template = future.result(timeout=self.limits.compile_timeout_s)
        except concurrent.futures.TimeoutError:
            raise StructuredOutputError(f"{params.kind}: compiling took longer than the limit of "
                                        f"{self.limits.compile_timeout_s:g} s") from None
        if template.is_error():
            raise StructuredOutputError(f"{params.kind}: {_first_line(template.get_error())}")
        return template

    def matcher(self, compiled: llguidance.LLMatcher) -> LLGuidanceMatcher:
        return LLGuidanceMatcher(compiled.deep_copy())

    def fill_bitmask(self, matchers: Sequence[tuple[Matcher, int]], bitmask: torch.Tensor) -> None:
        if not matchers:
            return
        self.check_bitmask(matchers, bitmask)
        rows, words = bitmask.shape
        pairs = [(m.ll, row) for m, row in matchers]  # type: ignore[attr-defined]
        self.executor.unsafe_compute_mask_ptr(pairs, bitmask.data_ptr(), words * 4, rows)


def _slices() -> list[str]:
    """llguidance's default slices plus JSON-string bodies of at most 3, 6, 15 and 20 characters.

    A slice is a token subset precomputed once; where the lexer allows at least a slice's whole
    language (the rest of a string with room for 15 more characters), the mask takes that subset at
    once instead of walking the token trie. The defaults stop at 10, 30 and unbounded, so a string
    with ``maxLength`` and fewer than 10 characters left walked all 49k tokens per row: these halve
    the 256-row fill of typical extraction schemas (bench/structured.py: 4.7 -> 2.7 ms) for
    ~0.1 s more at start-up. Masks are the same with or without them."""
    body = '[^"\\\\\\x00-\\x1F\\x7F]'  # what a JSON string holds unescaped
    return [*llguidance.LLTokenizer.general_slices(), *(f"{body}{{1,{n}}}" for n in (3, 6, 15, 20))]


def _first_line(message: str) -> str:
    """llguidance errors may carry a caret diagram over several lines: keep the first line and the
    ``error: ...`` line that names the problem."""
    lines = [ln.strip() for ln in message.strip().splitlines() if ln.strip()]
    kept = lines[:1] + [ln for ln in lines[1:] if ln.startswith("error:")]
    return " ".join(kept) if kept else "the grammar is invalid"
