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

import threading
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from batchinfer.workers.structured.params import StructuredLimits, StructuredOutputsParams

if TYPE_CHECKING:
    import torch

    from batchinfer.workers.text.tokenizer import Tokenizer

BACKENDS = ("llguidance", "xgrammar")
DEFAULT_BACKEND = "llguidance"


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
        self.num_compiles = 0  # cache misses, for metrics and tests

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
        compiled = self._compile(params)  # outside the lock: compiles of other specs may run meanwhile
        with self._lock:
            self.num_compiles += 1
            self._cache[key] = compiled
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return compiled

    def validate(self, params: StructuredOutputsParams) -> None:
        """``StructuredOutputError`` when ``params`` cannot be served (what the scheduler checks)."""
        self.compile(params)

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
