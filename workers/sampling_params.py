"""``SamplingParams``: how one request's completions are sampled and when they stop.

Names and meanings follow vLLM / the OpenAI API so users' habits carry over. Every field is
validated in ``__post_init__`` (types included: ``True`` is not an int), and every error is a
``ValueError`` whose message starts with the field's name, so the queue can quote it back in an
error row.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any, ClassVar

from batchinfer.workers.structured_params import StructuredOutputsParams

# Temperatures below this are treated as greedy (as vLLM does): dividing by them would only
# turn sampling into a numerically fragile argmax.
GREEDY_EPS = 1e-5
MAX_LOGPROBS = 20
# logit_bias entries per request: OpenAI's API refuses more than 300 ("logit_bias may not have more
# than 300 tokens"); bad_words shares the bound, which also bounds the sampler's per-step matching.
MAX_LOGIT_BIAS = 300
MAX_BAD_WORDS = 300
LOGIT_BIAS_RANGE = 100.0  # OpenAI's: each bias in [-100, 100]
# Seeds are fed to torch.Generator.manual_seed through a 64-bit mix; any 64-bit value is allowed.
_SEED_MIN, _SEED_MAX = -(2**63), 2**64 - 1
# What the engine hands back while a request runs (vLLM's RequestOutputKind): "cumulative", the
# request's state after every step it moved in; "final_only", one output when it finishes.
OUTPUT_KINDS = ("cumulative", "final_only")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass
class SamplingParams:
    """Sampling and stopping parameters of one request (all of its ``n`` completions)."""

    n: int = 1
    max_tokens: int | None = 16  # None: until max_model_len
    min_tokens: int = 0
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0  # (0, 1]
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0  # [0, 1]
    presence_penalty: float = 0.0  # [-2, 2]
    frequency_penalty: float = 0.0  # [-2, 2]
    repetition_penalty: float = 1.0  # > 0; 1 = off
    seed: int | None = None
    stop: str | list[str] | None = None  # normalised to list[str]
    stop_token_ids: list[int] | None = None  # normalised to list[int]
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None  # top-k logprobs per sampled token, 0..20
    skip_special_tokens: bool = True
    # Constrain the output to a JSON schema / regex / choice / grammar (vLLM's field); a dict is
    # converted. See batchinfer.workers.structured.
    structured_outputs: StructuredOutputsParams | None = None
    # Added to the logits before every sampling stage (OpenAI's field): {token id: bias in
    # [-100, 100]}; JSON's string keys ("50256") are read as ints. Normalised to dict[int, float].
    logit_bias: dict[int, float] | None = None
    # Only these token ids may be sampled (vLLM's field); a non-empty list.
    allowed_token_ids: list[int] | None = None
    # Words never generated (vLLM's field): the engine bans each one's token sequences, tokenised
    # as given and with a leading space.
    bad_words: list[str] | None = None
    # "final_only": no RequestOutput until the request finishes (callers that read only final
    # outputs skip building one per step); see OUTPUT_KINDS.
    output_kind: str = "cumulative"
    # Speculative decoding (batchinfer.workers.spec), which never changes the output: False keeps
    # this request from getting draft tokens; `prediction` is OpenAI's predicted output text, which
    # drafts for the request when the engine speculates.
    speculative: bool = True
    prediction: str | None = None

    FIELDS: ClassVar[tuple[str, ...]]  # the allowed field names, set below the class

    def __post_init__(self) -> None:
        self._check_int("n", minimum=1)
        if self.max_tokens is not None:
            self._check_int("max_tokens", minimum=1)
        self._check_int("min_tokens", minimum=0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        self._check_float("temperature", 0.0, math.inf, "must be >= 0")
        self._check_float("top_p", 0.0, 1.0, "must be in (0, 1]", open_low=True)
        self._check_int("top_k", minimum=-1)
        if self.top_k == -1:
            self.top_k = 0  # one spelling of "off"
        self._check_float("min_p", 0.0, 1.0, "must be in [0, 1]")
        self._check_float("presence_penalty", -2.0, 2.0, "must be in [-2, 2]")
        self._check_float("frequency_penalty", -2.0, 2.0, "must be in [-2, 2]")
        self._check_float("repetition_penalty", 0.0, math.inf, "must be > 0", open_low=True)
        if self.seed is not None:
            self._check_int("seed", minimum=_SEED_MIN, maximum=_SEED_MAX)
        self.stop = self._normalise_stop(self.stop)
        self.stop_token_ids = self._normalise_token_ids(self.stop_token_ids)
        if self.logit_bias is not None:
            self.logit_bias = _normalise_logit_bias(self.logit_bias)
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = self._normalise_token_ids(self.allowed_token_ids, "allowed_token_ids")
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids must not be empty (null allows every token)")
        if self.bad_words is not None:
            self.bad_words = _normalise_bad_words(self.bad_words)
        for name in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens", "speculative"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a boolean, got {getattr(self, name)!r}")
        if self.logprobs is not None:
            self._check_int("logprobs", minimum=0, maximum=MAX_LOGPROBS)
        if self.structured_outputs is not None and not isinstance(self.structured_outputs,
                                                                  StructuredOutputsParams):
            so = self.structured_outputs
            if not isinstance(so, Mapping):
                raise ValueError(f"structured_outputs must be an object, got {so!r}")
            self.structured_outputs = StructuredOutputsParams.from_dict(so)
        if self.prediction is not None and not isinstance(self.prediction, str):
            raise ValueError(f"prediction must be a string (the predicted output text) or null, "
                             f"got {type(self.prediction).__name__}")
        if self.output_kind not in OUTPUT_KINDS:
            raise ValueError(f"output_kind must be one of {', '.join(map(repr, OUTPUT_KINDS))}, "
                             f"got {self.output_kind!r}")

    # -- validation helpers ---------------------------------------------------------------------

    def _check_int(self, name: str, minimum: int, maximum: int | None = None) -> None:
        value = getattr(self, name)
        if not _is_int(value):
            raise ValueError(f"{name} must be an integer, got {value!r}")
        if value < minimum or (maximum is not None and value > maximum):
            bound = f"in [{minimum}, {maximum}]" if maximum is not None else f">= {minimum}"
            raise ValueError(f"{name} must be {bound}, got {value}")

    def _check_float(self, name: str, low: float, high: float, rule: str, open_low: bool = False) -> None:
        value = getattr(self, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{name} must be a number, got {value!r}")
        try:
            value = float(value)  # JSON gives 1 for 1.0
        except OverflowError:  # an int past float's range
            raise ValueError(f"{name} must be a finite number, got an integer of {len(str(value))} "
                             "digits") from None
        if not math.isfinite(value):  # JSON's 1e400 reads as infinity
            raise ValueError(f"{name} must be a finite number, got {value}")
        if value < low or value > high or (open_low and value == low):
            raise ValueError(f"{name} {rule}, got {value}")
        setattr(self, name, value)

    @staticmethod
    def _normalise_stop(stop: Any) -> list[str]:
        if stop is None:
            return []
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, (list, tuple)):
            raise ValueError(f"stop must be a string or a list of strings, got {stop!r}")
        return _non_empty_strings(stop, "stop")

    @staticmethod
    def _normalise_token_ids(ids: Any, name: str = "stop_token_ids") -> list[int]:
        if ids is None:
            return []
        if not isinstance(ids, (list, tuple)):
            raise ValueError(f"{name} must be a list of integers, got {ids!r}")
        for i, t in enumerate(ids):
            if not _is_int(t) or t < 0:
                raise ValueError(f"{name}[{i}] must be a non-negative integer, got {t!r}")
        return list(ids)

    # -- (de)serialisation ----------------------------------------------------------------------

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> SamplingParams:
        """Build from a JSON-like mapping; an unknown key is a ``ValueError`` naming it.

        ``null`` for a field that cannot be ``None`` means "the default", as in the OpenAI API.
        """
        if not isinstance(d, Mapping):
            raise ValueError(f"sampling parameters must be an object, got {type(d).__name__}")
        unknown = sorted(k for k in d if k not in cls.FIELDS)
        if unknown:
            raise ValueError(
                f"{unknown[0]} is not a sampling parameter (unknown: {', '.join(map(str, unknown))}; "
                f"allowed: {', '.join(cls.FIELDS)})")
        kwargs = {k: v for k, v in d.items() if v is not None or k in _NULLABLE}
        return cls(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict of every field; ``from_dict(p.to_dict()) == p``."""
        d = asdict(self)
        if self.structured_outputs is not None:
            d["structured_outputs"] = self.structured_outputs.to_dict()
        return d

    def copy(self) -> SamplingParams:
        """An independent copy, not validated again: what one request may change (``output_kind``,
        ``skip_special_tokens``) or the engine keeps stays its own. The lists and dicts are copied;
        ``structured_outputs`` is frozen and shared."""
        new = object.__new__(type(self))
        new.__dict__.update(self.__dict__)
        for name in _CONTAINERS:
            value = getattr(self, name)
            if value is not None:
                setattr(new, name, value.copy())
        return new

    @property
    def final_only(self) -> bool:
        """True when the engine hands out this request's output only once it finishes."""
        return self.output_kind == "final_only"

    @property
    def greedy(self) -> bool:
        """True when the next token is the argmax: temperature 0 (below ``GREEDY_EPS``)."""
        return self.temperature < GREEDY_EPS


SamplingParams.FIELDS = tuple(f.name for f in fields(SamplingParams))
# the fields whose values are (normalised to) lists or dicts: what copy() must not share
_CONTAINERS = ("stop", "stop_token_ids", "logit_bias", "allowed_token_ids", "bad_words")
_NULLABLE = frozenset({"max_tokens", "seed", "stop", "stop_token_ids", "logprobs", "structured_outputs",
                       "logit_bias", "allowed_token_ids", "bad_words", "prediction"})


def _token_key(key: Any) -> int:
    """A logit_bias key as a token id: an int, or its decimal digits as a JSON object key gives them."""
    if _is_int(key) and key >= 0:
        return int(key)
    # at most 18 digits: int() of a long digit string is slow, and no vocabulary is that large
    if isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 18:
        return int(key)
    raise ValueError(f"logit_bias keys must be token ids (non-negative integers, or their decimal "
                     f"digits as a string), got {key!r}")


def _normalise_logit_bias(bias: Any) -> dict[int, float]:
    """{token id: bias} with int keys and float values in [-100, 100]; errors name the entry."""
    if not isinstance(bias, Mapping):
        raise ValueError(f"logit_bias must be an object mapping token ids to numbers, got {bias!r}")
    if len(bias) > MAX_LOGIT_BIAS:
        raise ValueError(f"logit_bias may have at most {MAX_LOGIT_BIAS} tokens, got {len(bias)}")
    out: dict[int, float] = {}
    keys: dict[int, Any] = {}  # token id -> the key that named it
    for key, value in bias.items():
        token = _token_key(key)
        if token in keys:
            raise ValueError(f"logit_bias names token {token} twice (keys {keys[token]!r} and {key!r})")
        keys[token] = key
        where = f"logit_bias[{token}]"
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{where} must be a number, got {value!r}")
        try:
            number = float(value)
        except OverflowError:  # an int past float's range
            raise ValueError(f"{where} must be in [-100, 100], got an integer of {len(str(value))} "
                             "digits") from None
        if not -LOGIT_BIAS_RANGE <= number <= LOGIT_BIAS_RANGE:  # NaN fails both comparisons
            raise ValueError(f"{where} must be in [-100, 100], got {number}")
        out[token] = number
    return out


def _normalise_bad_words(words: Any) -> list[str]:
    if isinstance(words, str) or not isinstance(words, (list, tuple)):
        raise ValueError(f"bad_words must be a list of strings, got {words!r}")
    if len(words) > MAX_BAD_WORDS:
        raise ValueError(f"bad_words may have at most {MAX_BAD_WORDS} words, got {len(words)}")
    return _non_empty_strings(words, "bad_words")


def _non_empty_strings(values: list[Any] | tuple[Any, ...], name: str) -> list[str]:
    """``values`` as a list once every element is a non-empty string (ValueError naming ``name[i]``)."""
    for i, v in enumerate(values):
        if not isinstance(v, str):
            raise ValueError(f"{name}[{i}] must be a string, got {v!r}")
        if not v:
            raise ValueError(f"{name}[{i}] must not be empty")
    return list(values)
