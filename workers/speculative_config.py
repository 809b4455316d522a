"""``SpeculativeConfig``: how an engine drafts tokens for speculative decoding (vLLM's speculative_config).

Built with :meth:`SpeculativeConfig.from_value` from what ``LLM(speculative_config=...)``,
``--engine-option speculative_config=...`` and the worker's ``--speculative-config JSON`` give: None,
a dict in vLLM's shape, its JSON text, or an instance. vLLM's spellings are accepted where they
differ only by name (method ``"draft_model"``, the ``suffix_decoding_*`` keys). Every error is a
``ValueError`` whose message starts with ``speculative_config.<field>`` (``speculative_config``
alone when the value as a whole is wrong).

It lives beside ``engine_config`` (as ``structured_params`` does), not in ``workers/spec``: the
engine config holds one, and ``batchinfer.workers.spec`` imports the engine, so a config inside it
would close a package import circle.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any, ClassVar

METHODS = ("ngram", "suffix", "draft")  # a request's own `prediction` drafts with any of them, or none
METHOD_ALIASES = {"draft_model": "draft"}  # vLLM's names -> ours
# vLLM's key names for the same settings -> ours
KEY_ALIASES = {
    "suffix_decoding_max_tree_depth": "suffix_max_depth",
    "suffix_decoding_max_cached_requests": "suffix_max_cached_requests",
    "suffix_decoding_min_token_prob": "suffix_min_token_prob",
    "suffix_decoding_max_spec_factor": "suffix_max_spec_factor",
}
# Past this many running sequences no drafts are proposed: a full batch is compute-bound, where
# verifying drafts costs more than it saves (to be measured by the bench).
DEFAULT_DISABLE_BY_BATCH_SIZE = 16
MAX_SPECULATIVE_TOKENS = 32
MAX_NGRAM = 32
SUFFIX_DEPTH_RANGE = (2, 256)


@dataclass(frozen=True)
class SpeculativeConfig:
    """What the engine's speculative decoder proposes with; see docs/speculative.md."""

    # "ngram" (prompt lookup), "suffix" (suffix trees over this request and its job's earlier
    # outputs), "draft" (a small model with the target's tokenizer); None: only requests that carry
    # a `prediction` speculate. A `model` with no method means "draft".
    method: str | None = None
    num_speculative_tokens: int = 4  # drafts per sequence per step, 1..32
    prompt_lookup_min: int = 2  # ngram: the shortest and longest suffix matched, 1 <= min <= max <= 32
    prompt_lookup_max: int = 5
    model: str | None = None  # draft: the draft model's folder (same tokenizer as the target)
    draft_num_kv_blocks: int | None = None  # draft: its KV cache in blocks (None: sized by the proposer)
    # No drafts while more sequences than this run; None: never off.
    disable_by_batch_size: int | None = DEFAULT_DISABLE_BY_BATCH_SIZE
    # suffix: tree depth (2..256), finished outputs kept per group (0: no cross-request history),
    # the least probability of a drafted token (0..1), drafts per matched token (> 0).
    suffix_max_depth: int = 24
    suffix_max_cached_requests: int = 1000
    suffix_min_token_prob: float = 0.1
    suffix_max_spec_factor: float = 1.0
    use_predictions: bool = True  # a request's `prediction` drafts for it (before the method)

    FIELDS: ClassVar[tuple[str, ...]]  # the field names, set below the class

    def __post_init__(self) -> None:
        self._check_method()
        self._check_int("num_speculative_tokens", 1, MAX_SPECULATIVE_TOKENS)
        self._check_int("prompt_lookup_min", 1, MAX_NGRAM)
        self._check_int("prompt_lookup_max", 1, MAX_NGRAM)
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config.prompt_lookup_min ({self.prompt_lookup_min}) must be <= "
                             f"prompt_lookup_max ({self.prompt_lookup_max})")
        if self.draft_num_kv_blocks is not None:
            self._check_int("draft_num_kv_blocks", 1)
        if self.disable_by_batch_size is not None:
            self._check_int("disable_by_batch_size", 1)
        self._check_int("suffix_max_depth", *SUFFIX_DEPTH_RANGE)
        self._check_int("suffix_max_cached_requests", 0)
        self._check_float("suffix_min_token_prob", "in [0, 1]", lambda v: 0.0 <= v <= 1.0)
        self._check_float("suffix_max_spec_factor", "> 0", lambda v: v > 0)
        if not isinstance(self.use_predictions, bool):
            raise ValueError(f"speculative_config.use_predictions must be a boolean, "
                             f"got {self.use_predictions!r}")

    def _check_method(self) -> None:
        method, model = self.method, self.model
        if model is not None and (not isinstance(model, str) or not model):
            raise ValueError(f"speculative_config.model must be a draft model folder, got {model!r}")
        if method is None and model is not None:
            method = "draft"
        if method is not None:
            if not isinstance(method, str) or METHOD_ALIASES.get(method, method) not in METHODS:
                raise ValueError(f"speculative_config.method must be one of {', '.join(METHODS)} "
                                 f"(or null: predictions only), got {method!r}")
            method = METHOD_ALIASES.get(method, method)
        if method == "draft" and model is None:
            raise ValueError("speculative_config.model is needed by method 'draft': the draft model's folder")
        if method != "draft" and model is not None:
            raise ValueError(f"speculative_config.model is the draft model of method 'draft', "
                             f"not of method {method!r}")
        object.__setattr__(self, "method", method)

    def _check_int(self, name: str, low: int, high: int | None = None) -> None:
        value = getattr(self, name)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"speculative_config.{name} must be an integer, got {value!r}")
        if value < low or (high is not None and value > high):
            bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
            raise ValueError(f"speculative_config.{name} must be {bound}, got {value}")

    def _check_float(self, name: str, rule: str, ok: Callable[[float], bool]) -> None:
        value = getattr(self, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"speculative_config.{name} must be a number, got {value!r}")
        try:
            number = float(value)  # JSON gives 1 for 1.0
        except OverflowError:
            number = math.inf
        if not math.isfinite(number) or not ok(number):
            raise ValueError(f"speculative_config.{name} must be {rule}, got {value!r}")
        object.__setattr__(self, name, number)

    # -- building and serialising ---------------------------------------------------------------

    @classmethod
    def from_value(cls, value: Any) -> SpeculativeConfig | None:
        """None -> None; an instance as is; a dict (vLLM's keys) or its JSON text -> a config.

        An unknown key is a ValueError naming it and the allowed ones.
        """
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config must be a JSON object such as "
                                 f"'{{\"method\": \"ngram\"}}': invalid JSON ({e.msg} at column "
                                 f"{e.colno})") from None
        if not isinstance(value, Mapping):
            raise ValueError(f"speculative_config must be an object (a dict or its JSON text), "
                             f"got {type(value).__name__}")
        kwargs: dict[str, Any] = {}
        for key, item in value.items():
            name = KEY_ALIASES.get(key, key) if isinstance(key, str) else key
            if name not in cls.FIELDS:
                raise ValueError(f"speculative_config.{key} is not a speculative decoding setting "
                                 f"(allowed: {', '.join(cls.FIELDS)})")
            if name in kwargs:
                raise ValueError(f"speculative_config.{name} is given twice (as {name} and an alias of it)")
            kwargs[name] = item
        return cls(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict of every field; ``from_value(c.to_dict()) == c``."""
        return asdict(self)


SpeculativeConfig.FIELDS = tuple(f.name for f in fields(SpeculativeConfig))
