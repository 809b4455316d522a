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

from batchinfer.workers.structured.backend import GrammarBackend, Matcher, StructuredOutputError
from batchinfer.workers.structured.params import StructuredOutputsParams

if TYPE_CHECKING:
    import torch

# Rust's regex crate accepts a backslash before any ASCII punctuation; escaping exactly the
# metacharacters keeps choice strings literal.
_REGEX_META = re.compile(r"([\\.+*?()|\[\]{}^$#&\-~])")


class LLGuidanceMatcher(Matcher):
    """A wrapped ``llguidance.LLMatcher``."""

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self.ll = matcher

    def accept(self, token_id: int) -> bool:
        return bool(self.ll.consume_token(token_id))

    def rollback(self, num_tokens: int) -> None:
        if num_tokens and not self.ll.rollback(num_tokens):
            raise RuntimeError(f"llguidance could not roll back {num_tokens} tokens: {self.ll.get_error()}")

    def forced_tokens(self) -> list[int]:
        return list(self.ll.compute_ff_tokens())

    @property
    def is_terminated(self) -> bool:
        return bool(self.ll.is_stopped())

    @property
    def is_accepting(self) -> bool:
        return bool(self.ll.is_accepting())

    @property
    def error(self) -> str | None:
        return self.ll.get_error() or None if self.ll.is_error() else None


class LLGuidanceBackend(GrammarBackend):
    """llguidance bound to one tokenizer (see :class:`GrammarBackend`)."""

    name = "llguidance"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        eos = self.eos_token_ids or None
        self.ll_tokenizer = llguidance.LLTokenizer(self.tokenizer.backend.to_str(), n_vocab=self.vocab_size,
                                                   eos_token=eos)
        self.executor = llguidance.LLExecutor(self.num_threads)
        self._compiler = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="grammar-compile")

    def grammar_text(self, params: StructuredOutputsParams) -> str:
        """The llguidance grammar (its JSON form) for ``params``."""
        kind, spec = params.kind, params.spec
        if kind in ("json", "json_object"):
            schema: Any = {"type": "object"} if kind == "json_object" else spec
            if params.disable_additional_properties:
                schema = closed_objects(schema)
            options = {"whitespace_flexible": not params.disable_any_whitespace}
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
        future = self._compiler.submit(llguidance.LLMatcher, self.ll_tokenizer, grammar, log_level=0)
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
        if not (bitmask.is_contiguous() and bitmask.device.type == "cpu"):
            raise ValueError("the bitmask must be a contiguous CPU tensor")
        rows, words = bitmask.shape
        pairs = [(m.ll, row) for m, row in matchers]  # type: ignore[attr-defined]
        self.executor.unsafe_compute_mask_ptr(pairs, bitmask.data_ptr(), words * 4, rows)


def closed_objects(schema: Any) -> Any:
    """A copy of ``schema`` where every object schema without ``additionalProperties`` gets
    ``false`` (OpenAI's strict mode), walked without recursion."""
    import copy

    root = copy.deepcopy(schema)
    stack = [root]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if (node.get("type") == "object" or "properties" in node) and "additionalProperties" not in node:
                node["additionalProperties"] = False
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return root


def _first_line(message: str) -> str:
    """llguidance errors may carry a caret diagram over several lines: keep the first line and the
    ``error: ...`` line that names the problem."""
    lines = [ln.strip() for ln in message.strip().splitlines() if ln.strip()]
    kept = lines[:1] + [ln for ln in lines[1:] if ln.startswith("error:")]
    return " ".join(kept) if kept else "the grammar is invalid"
