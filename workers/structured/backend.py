"""The grammar backend contract: compile a spec -> a matcher per completion -> fill the batch's
token bitmask -> accept tokens -> roll back.

A backend is built once per engine for its tokenizer; ``compile`` caches compiled grammars by the
spec's canonical key (an LRU of ``cache_size``), so a job whose million rows share one schema
compiles it once per worker. Each completion gets its own :class:`Matcher` (``backend.matcher``).

The bitmask is int32 ``[rows, ceil(vocab_size / 32)]``: bit ``t % 32`` of word ``t // 32`` set means
token ``t`` may come next (the layout llguidance and xgrammar share). ``fill_bitmask`` fills the
given rows, in parallel and without the GIL where the backend can, so the engine may run it on a
thread while the model runs; :func:`~batchinfer.workers.structured.bitmask.apply_bitmask` then sets
the logits of disallowed tokens to ``-inf``.

Every compile problem (an invalid or unsupported schema, a regex that does not compile, a limit
hit) is a :class:`StructuredOutputError` whose message says what is wrong.
"""

from __future__ import annotations

import copy
import threading
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from batchinfer.workers.structured_params import StructuredLimits, StructuredOutputsParams

if TYPE_CHECKING:
    import torch

    from batchinfer.workers.text.tokenizer import Tokenizer

DEFAULT_BACKEND = "llguidance"
# Tokens a validation runs a fresh matcher through (``GrammarBackend.probe``): specs that compile but
# fail on their first token (a parser row over its item limit, a lexer out of fuel) fail there.
PROBE_STEPS = 4


class StructuredOutputError(ValueError):
    """A spec that cannot be served: invalid, unsupported by the backend, or over a limit."""


class Matcher(ABC):
    """One completion's position in its grammar."""

    @abstractmethod
    def accept(self, token_id: int) -> bool:
        """Advance by one generated token; False (and the matcher unusable) when the grammar
        does not allow it. An EOS token is accepted where the grammar may end."""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens."""

    @abstractmethod
    def validate(self, token_ids: Sequence[int]) -> int:
        """How many of ``token_ids``, in order from the current state, the grammar accepts; the
        matcher's state is left as it was (speculative decoding checks its drafts with it)."""

    @abstractmethod
    def forced_tokens(self) -> list[int]:
        """The tokens the grammar forces next, in the tokenizer's own tokenization of the forced
        text (jump-forward); [] when the next token is a choice."""

    @property
    @abstractmethod
    def is_terminated(self) -> bool:
        """The output is complete: the grammar allows nothing more (but EOS)."""

    @property
    @abstractmethod
    def is_accepting(self) -> bool:
        """The output so far is a complete match (it may still continue)."""

    @property
    @abstractmethod
    def error(self) -> str | None:
        """Why the matcher failed (a rejected token, a parser limit), or None."""


class GrammarBackend(ABC):
    """A grammar library bound to one tokenizer; see the module docstring."""

    name: str

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: Sequence[int],
                 limits: StructuredLimits | None = None, cache_size: int = 256,
                 num_threads: int | None = None) -> None:
        """``vocab_size``: the model's (the logits' width, at least the tokenizer's);
        ``num_threads``: for the parallel bitmask fill (None: the backend's default)."""
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.limits = limits or StructuredLimits()
        self.num_threads = num_threads
        self._cache: OrderedDict[str, Any] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self._probed: OrderedDict[str, None] = OrderedDict()  # keys whose probe passed (an LRU)
        self.num_compiles = 0  # cache misses, for metrics and tests
        self.num_probes = 0

    def compile(self, params: StructuredOutputsParams) -> Any:
        """The compiled grammar of ``params`` (cached); ``StructuredOutputError`` when it cannot be."""
        try:
            params.check_limits(self.limits)
        except ValueError as e:
            raise StructuredOutputError(str(e)) from None
        key = params.key()
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        try:  # outside the lock: compiles of other specs may run meanwhile
            compiled = self._compile(params)
        except (StructuredOutputError, KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # noqa: BLE001 - a Rust panic (pyo3's PanicException is a
            # BaseException) or a library error on a hostile spec must cost this request only
            raise StructuredOutputError(f"{params.kind}: the {self.name} grammar library failed on it: "
                                        f"{type(e).__name__}: {e}") from None
        with self._lock:
            self.num_compiles += 1
            self._cache[key] = compiled
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return compiled

    def validate(self, params: StructuredOutputsParams) -> None:
        """``StructuredOutputError`` when ``params`` cannot be served (what the scheduler checks): its
        limits, its compile, then its first tokens (:meth:`probe`; once per spec, cached as compiles)."""
        compiled = self.compile(params)
        key = params.key()
        with self._lock:
            if key in self._probed:
                self._probed.move_to_end(key)
                return
        self.probe(params.kind, compiled)
        with self._lock:
            self._probed[key] = None
            while len(self._probed) > self._cache_size:
                self._probed.popitem(last=False)

    def probe(self, kind: str, compiled: Any, steps: int = PROBE_STEPS) -> None:
        """Run a fresh matcher of ``compiled`` through its first ``steps`` tokens as an engine would:
        the forced token where the text is forced, else the lowest allowed token of the mask (EOS
        aside). ``StructuredOutputError`` ``"<kind>: it fails on its first tokens: <why>"`` when the
        matcher fails: a grammar that compiles but that no worker could decode (a parser row over
        its item limit, a lexer out of fuel) is refused before it is dispatched."""
        from batchinfer.workers.structured.bitmask import first_allowed

        with self._lock:
            self.num_probes += 1
        why: str | None = None
        try:
            matcher = self.matcher(compiled)
            bitmask = self.allocate_bitmask(1)
            for _ in range(steps):
                forced = matcher.forced_tokens()
                if matcher.error is None and not forced:
                    self.fill_bitmask([(matcher, 0)], bitmask)
                if matcher.error is not None:
                    break
                eos = self.eos_token_ids
                token = forced[0] if forced else first_allowed(bitmask[0], self.vocab_size, eos)
                if token is None:
                    return  # only EOS may come: the output can end here
                if not matcher.accept(token):
                    why = matcher.error or f"its own allowed token {token} was rejected"
                    break
                if matcher.error is not None or matcher.is_terminated:
                    break
            why = why or matcher.error
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # noqa: BLE001 - as in compile: a library failure costs this spec
            why = f"the {self.name} grammar library failed: {type(e).__name__}: {e}"
        if why is not None:
            raise StructuredOutputError(f"{kind}: it fails on its first tokens: {why}")

    @abstractmethod
    def _compile(self, params: StructuredOutputsParams) -> Any:
        """Compile one spec (no cache): raise StructuredOutputError naming the problem."""

    @abstractmethod
    def matcher(self, compiled: Any) -> Matcher:
        """A fresh matcher at the start of ``compiled``."""

    def allocate_bitmask(self, rows: int) -> torch.Tensor:
        """int32 ``[rows, ceil(vocab_size / 32)]`` on the CPU, every token allowed."""
        import torch

        return torch.full((rows, (self.vocab_size + 31) // 32), -1, dtype=torch.int32)

    @abstractmethod
    def fill_bitmask(self, matchers: Sequence[tuple[Matcher, int]], bitmask: torch.Tensor) -> None:
        """Write each ``(matcher, row)``'s allowed next tokens into ``bitmask[row]``."""

    def check_bitmask(self, matchers: Sequence[tuple[Matcher, int]], bitmask: torch.Tensor) -> None:
        """``ValueError`` unless ``bitmask`` is what :meth:`allocate_bitmask` makes (a contiguous int32
        CPU tensor, ``ceil(vocab_size / 32)`` words a row) and every row is inside it: the
        libraries write through its raw pointer."""
        import torch

        words = (self.vocab_size + 31) // 32
        if not (bitmask.dtype == torch.int32 and bitmask.dim() == 2 and bitmask.shape[1] == words
                and bitmask.is_contiguous() and bitmask.device.type == "cpu"):
            raise ValueError(f"the bitmask must be a contiguous int32 CPU tensor [rows, {words}], got "
                             f"{bitmask.dtype} {list(bitmask.shape)} on {bitmask.device}")
        bad = [row for _, row in matchers if not 0 <= row < bitmask.shape[0]]
        if bad:
            raise ValueError(f"bitmask row {bad[0]} is outside the bitmask's {bitmask.shape[0]} rows")


# -- JSON schema helpers the backends share ---------------------------------------------------------

# Keywords whose value is one subschema, a list of subschemas, or a map of name -> subschema.
_SUBSCHEMA = ("additionalProperties", "items", "not", "propertyNames", "contains", "if", "then", "else",
              "unevaluatedProperties", "unevaluatedItems", "additionalItems")
_SUBSCHEMA_LIST = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def walk_schema(schema: Any) -> Iterator[tuple[str, dict[str, Any]]]:
    """Every object subschema of ``schema`` with its JSON pointer (``#``, ``#/properties/a``, ...),
    without recursion. Only schema positions are visited: the values of ``const``, ``enum``,
    ``default`` or ``examples`` are data, and the keys of ``properties`` are names, not keywords."""
    stack: list[tuple[str, Any]] = [("#", schema)]
    while stack:
        where, node = stack.pop()
        if not isinstance(node, dict):
            continue  # a boolean schema (or a malformed value the backend reports)
        yield where, node
        for key in _SUBSCHEMA:
            if key in node:
                value = node[key]
                if isinstance(value, list):  # draft-4..7 tuple ``items``
                    stack.extend((f"{where}/{key}/{i}", v) for i, v in enumerate(value))
                else:
                    stack.append((f"{where}/{key}", value))
        for key in _SUBSCHEMA_LIST:
            if isinstance(node.get(key), list):
                stack.extend((f"{where}/{key}/{i}", v) for i, v in enumerate(node[key]))
        for key in _SUBSCHEMA_MAP:
            if isinstance(node.get(key), dict):
                stack.extend((f"{where}/{key}/{_pointer_escape(k)}", v) for k, v in node[key].items())


def _pointer_escape(name: Any) -> str:
    return str(name).replace("~", "~0").replace("/", "~1")


def closed_objects(schema: Any) -> Any:
    """A copy of ``schema`` where every object schema without ``additionalProperties`` gets
    ``false`` (OpenAI's strict mode). Only schema positions change (see :func:`walk_schema`): a
    ``const`` or ``enum`` value that happens to look like an object schema is left as it is."""
    root = copy.deepcopy(schema)
    for _, node in walk_schema(root):
        kind = node.get("type")
        is_object = kind == "object" or (isinstance(kind, list) and "object" in kind) or "properties" in node
        if is_object and "additionalProperties" not in node:
            node["additionalProperties"] = False
    return root
