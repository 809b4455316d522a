"""``make_backend``: the grammar backend an engine (or the scheduler's validation) asks for by name."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from batchinfer.workers.structured.backend import GrammarBackend
from batchinfer.workers.structured_params import BACKENDS, StructuredLimits

if TYPE_CHECKING:
    from batchinfer.workers.text.tokenizer import Tokenizer


def make_backend(name: str, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: Sequence[int],
                 limits: StructuredLimits | None = None, cache_size: int = 256,
                 num_threads: int | None = None) -> GrammarBackend:
    """The backend called ``name`` (one of ``BACKENDS``) for ``tokenizer``.

    ``ValueError`` for an unknown name, or when the backend's library is not installed (saying how
    to install it)."""
    if name == "llguidance":
        from batchinfer.workers.structured.llguidance_backend import LLGuidanceBackend

        cls: type[GrammarBackend] = LLGuidanceBackend
    elif name == "xgrammar":
        try:
            from batchinfer.workers.structured.xgrammar_backend import XGrammarBackend
        except ImportError:
            raise ValueError("structured_outputs_backend 'xgrammar' needs the xgrammar package: "
                             "pip install 'batchinfer[xgrammar]'") from None
        cls = XGrammarBackend
    else:
        raise ValueError(f"structured_outputs_backend must be one of {', '.join(BACKENDS)}, got {name!r}")
    return cls(tokenizer, vocab_size, eos_token_ids, limits=limits, cache_size=cache_size,
               num_threads=num_threads)
