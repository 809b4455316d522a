"""The scheduler's check of a request's output constraint, before anything is dispatched.

A generation request with ``structured_outputs`` (from ``response_format``, ``structured_outputs`` or
``guided_*``: :mod:`batchinfer.protocol.structured_bodies`) is checked against the limits
(``BATCHINFER_STRUCTURED_*``), compiled with the default grammar backend (llguidance) built for
its model's tokenizer, and run through its first tokens (``GrammarBackend.probe``: the forced token,
else the lowest allowed one, as a worker's matcher would see them), so that an invalid or unsupported
schema, a regex that does not compile, a spec over a limit, or one that compiles but fails as soon as
it decodes (a Lark rule of 3,000 alternatives over the parser's 2,000 items a row, `(x{1000}){1000}`
out of lexer fuel) is an ``invalid_request`` row naming the body's field and the line, and never
reaches a worker. One backend per model (and tokenizer; a model's adapters share it); the backend's
LRU caches compiled and probed specs, so a job whose rows share one schema compiles and probes it
once. A compile is bounded by ``structured_compile_timeout_s`` and a probe's steps by the lexer fuel
(``structured_lexer_fuel``), so a hostile spec holds the intake briefly.

Workers compile again with the same limits (``batchinfer worker`` reads ``BATCHINFER_STRUCTURED_*``
too) and their own backend, which may be xgrammar: a spec that passes here and fails there, or that
fails later in its decode, is still an ``invalid_request`` row, from the worker, and never retried.
So when llguidance cannot read a model's tokenizer, that model's requests are checked against the
limits only (logged).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from batchinfer.config import Settings
from batchinfer.ops.startup import StartupError
from batchinfer.protocol.entries import RequestError
from batchinfer.workers.structured.backend import DEFAULT_BACKEND, GrammarBackend
from batchinfer.workers.structured_params import StructuredLimits, limits_from_settings

if TYPE_CHECKING:
    from batchinfer.protocol.bodies import RequestSpec
    from batchinfer.scheduler.lookups import ServedModel

log = logging.getLogger(__name__)

MAX_BACKENDS = 64  # models (tokenizers) whose backend is kept
# Which setting bounds what a limit message is about (StructuredOutputsParams.check_limits' wording).
_LIMIT_SETTINGS = (("bytes; the limit", "BATCHINFER_STRUCTURED_MAX_SPEC_BYTES"),
                   ("choices; the limit", "BATCHINFER_STRUCTURED_MAX_CHOICES"),
                   ("nests deeper than", "BATCHINFER_STRUCTURED_MAX_DEPTH"),
                   ("compiling took longer", "BATCHINFER_STRUCTURED_COMPILE_TIMEOUT_S"),
                   # llguidance's words for a lexer out of fuel (StructuredLimits.lexer_fuel)
                   ("too many expressions", "BATCHINFER_STRUCTURED_LEXER_FUEL"),
                   ("lexer configuration (grammar) too big", "BATCHINFER_STRUCTURED_LEXER_FUEL"))


def structured_limits(settings: Settings) -> StructuredLimits:
    """The limits ``settings`` give; ``StartupError`` naming a bad value."""
    try:
        return limits_from_settings(settings)
    except ValueError as e:
        raise StartupError(f"structured-output limits (BATCHINFER_STRUCTURED_*): {e}") from None


class StructuredCheck:
    """Checks and compiles requests' output constraints for their models (see the module docstring)."""

    def __init__(self, settings: Settings, backend: str = DEFAULT_BACKEND, cache_size: int = 1024):
        self.limits = structured_limits(settings)
        self.backend_name, self.cache_size = backend, cache_size
        # None: no backend could be built for that tokenizer (then the workers' engines decide alone)
        self._backends: dict[tuple[str, int], GrammarBackend | None] = {}

    def check(self, spec: RequestSpec, served: ServedModel) -> None:
        """``RequestError("invalid_request")`` naming the spec's body field when ``spec``'s constraint
        is over a limit or does not compile for ``served``'s tokenizer; nothing for a free request."""
        params = spec.sampling_params.structured_outputs
        if params is None:
            return
        where = spec.structured_field or "structured_outputs"
        try:
            backend = self._backend(served)
            if backend is not None:
                backend.validate(params)  # the limits first, then a compile (or a hit of its cache)
            else:
                params.check_limits(self.limits)
        except ValueError as e:  # StructuredOutputError, or check_limits' ValueError
            raise RequestError("invalid_request", _message(str(e), params.kind, where), field=where) from None
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # noqa: BLE001 - a Rust panic in the grammar library (pyo3's
            # PanicException is a BaseException) must cost this request, not the scheduler
            log.exception("model %s: the grammar library failed on a %s spec", served.info.name, params.kind)
            raise RequestError("invalid_request", f"{where}: the grammar library failed on this spec "
                               f"({type(e).__name__}: {e})", field=where) from None

    def _backend(self, served: ServedModel) -> GrammarBackend | None:
        # A base model and its adapters (``BASE:NAME``) share one tokenizer object (the ModelCache
        # shares identical tokenizer files), hence one backend; the backend holds the tokenizer,
        # so its id is not reused while the entry lives.
        key = (served.info.base_model or served.info.name, id(served.tokenizer))
        if key in self._backends:
            return self._backends[key]
        from batchinfer.workers.structured.factory import make_backend

        if len(self._backends) >= MAX_BACKENDS:
            self._backends.clear()  # bounded memory; a miss rebuilds one backend
        tokenizer = served.tokenizer
        eos = served.info.eos_token_ids or tokenizer.eos_token_ids
        backend: GrammarBackend | None
        try:  # one mask thread: the scheduler compiles, it never fills masks
            backend = make_backend(self.backend_name, tokenizer, tokenizer.vocab_size, eos,
                                   limits=self.limits, cache_size=self.cache_size, num_threads=1)
            log.info("model %s: structured-output checks compile with %s", served.info.name,
                     self.backend_name)
        except Exception as e:  # noqa: BLE001 - the grammar library's view of a tokenizer it cannot read
            backend = None
            log.warning("model %s: no %s backend for its tokenizer (%r); its structured-output requests are "
                        "checked against the limits only, and compiled by the workers", served.info.name,
                        self.backend_name, e)
        self._backends[key] = backend
        return backend


def _message(text: str, kind: str, where: str) -> str:
    """The backend's message (``"<kind>: what is wrong"``) with the body's field first, and the setting
    that bounds a limit that was hit."""
    text = text.removeprefix(f"{kind}: ").replace(f"the {kind} is ", "it is ")  # "json: the json is 9 bytes"
    for words, setting in _LIMIT_SETTINGS:
        if words in text:
            text = f"{text} ({setting})"
            break
    return f"{where}: {text}"
