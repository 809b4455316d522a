"""``StructuredOutputsParams``: what one request's output must match, with vLLM's names.

Exactly one of ``json`` (a JSON schema), ``regex``, ``choice``, ``grammar`` (Lark, or EBNF / GBNF
with ``::=`` rules) or ``json_object`` (any JSON object) is set. Validation here is of shape and
size only (torch- and backend-free, so the queue side can run it); whether a schema or a regex
compiles is the backend's question (:mod:`batchinfer.workers.structured.backend`). Every error is a
``ValueError`` whose message starts with the field's name.

Hostile input is bounded by :class:`StructuredLimits`: a schema's size in bytes, its nesting depth,
the number of choices, the compile time a backend may spend on one spec, and the regex work (lexer
fuel) its matchers may do, which bounds what one request's mask costs a step.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, ClassVar

KINDS = ("json", "regex", "choice", "grammar", "json_object")
BACKENDS = ("llguidance", "xgrammar")  # structured_outputs_backend names (structured/backend.py)
_OPTIONS = ("disable_any_whitespace", "disable_additional_properties")


@dataclass(frozen=True)
class StructuredLimits:
    """Bounds on one structured-output spec; every one is settable (EngineConfig, scheduler flags)."""

    max_spec_bytes: int = 64 * 1024  # a schema / regex / grammar / choice list, as compact JSON
    max_depth: int = 32  # nesting of a schema's objects and lists
    max_choices: int = 1024
    compile_timeout_s: float = 5.0  # wall time a backend may spend compiling one spec
    # llguidance's lexer fuel for one spec (its ``initial_lexer_fuel``, ~50k a millisecond): the regex
    # work the lexer may do (derivative expressions built, forced text looked ahead) before the spec
    # fails. llguidance's default, 1,000,000, let `(x{300}){300}` cost ~50 ms a step per request;
    # 100,000 fails it on its first token and leaves every realistic schema as it was.
    lexer_fuel: int = 100_000

    def __post_init__(self) -> None:
        for name in ("max_spec_bytes", "max_depth", "max_choices", "lexer_fuel"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        t = self.compile_timeout_s
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not t > 0:
            raise ValueError(f"compile_timeout_s must be a positive number, got {t!r}")


def limits_from_settings(settings: Any, overrides: StructuredLimits | Mapping[str, Any] | None = None
                         ) -> StructuredLimits:
    """The limits a ``batchinfer.config.Settings`` gives (``BATCHINFER_STRUCTURED_*``: the scheduler's
    check and the workers' engines read the same ones), with ``overrides`` (a worker's own
    ``--engine-option structured_limits=...``) on top. ``ValueError`` naming a bad or unknown limit."""
    if isinstance(overrides, StructuredLimits):
        return overrides
    if overrides is not None and not isinstance(overrides, Mapping):
        raise ValueError(f"structured_limits must be an object of limits, got {overrides!r}")
    values: dict[str, Any] = {
        "max_spec_bytes": settings.structured_max_spec_bytes, "max_depth": settings.structured_max_depth,
        "max_choices": settings.structured_max_choices,
        "compile_timeout_s": settings.structured_compile_timeout_s,
        "lexer_fuel": settings.structured_lexer_fuel}
    unknown = sorted(set(overrides or {}) - set(values))
    if unknown:
        raise ValueError(f"structured_limits: unknown limit(s) {', '.join(map(str, unknown))}; "
                         f"the limits are {', '.join(values)}")
    values.update(overrides or {})
    return StructuredLimits(**values)


@dataclass(frozen=True)
class StructuredOutputsParams:
    """One request's output constraint (vLLM's ``StructuredOutputsParams``).

    ``json`` may be given as a dict or as its JSON text; it is kept as a dict. Whitespace: by
    default the JSON is compact (``{"a":1,"b":[2,3]}``), because free whitespace lets a model loop on
    spaces and newlines until ``max_tokens``; ``disable_any_whitespace=False`` allows it (vLLM's
    default). ``disable_additional_properties`` treats every object schema without an
    ``additionalProperties`` of its own as closed (OpenAI's ``strict: true``).
    """

    json: dict[str, Any] | bool | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = True
    disable_additional_properties: bool = False

    FIELDS: ClassVar[tuple[str, ...]]

    def __post_init__(self) -> None:
        if self.json is False:  # the schema `false` matches nothing (said before "give exactly one")
            raise ValueError("json: the schema false matches no value")
        given = [k for k in KINDS if _given(getattr(self, k))]
        if len(given) != 1:
            got = ", ".join(given) if given else "none"
            raise ValueError(f"structured_outputs: give exactly one of {', '.join(KINDS)} (got {got})")
        if isinstance(self.json, str):
            try:
                object.__setattr__(self, "json", json.loads(self.json))
            except ValueError as e:
                raise ValueError(f"json: the schema is not valid JSON: {e}") from None
            except RecursionError:  # nested deeper than Python's parser goes: far over any limit
                raise ValueError("json: the schema nests too deeply to parse") from None
        if self.json is not None and not isinstance(self.json, (dict, bool)):
            raise ValueError(f"json must be a JSON schema (an object), got {type(self.json).__name__}")
        if self.json is False:  # a JSON text "false"
            raise ValueError("json: the schema false matches no value")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"{name} must be a non-empty string, got {value!r}")
        if self.choice is not None:
            choice = self.choice
            if not isinstance(choice, (list, tuple)) or not choice:
                raise ValueError(f"choice must be a non-empty list of strings, got {choice!r}")
            for i, c in enumerate(choice):
                if not isinstance(c, str) or not c:
                    raise ValueError(f"choice[{i}] must be a non-empty string, got {c!r}")
            object.__setattr__(self, "choice", tuple(choice))
        if self.json_object is not None and not isinstance(self.json_object, bool):
            raise ValueError(f"json_object must be a boolean, got {self.json_object!r}")
        for name in ("disable_any_whitespace", "disable_additional_properties"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a boolean, got {getattr(self, name)!r}")

    @property
    def kind(self) -> str:
        """Which constraint this is: one of ``KINDS``."""
        return next(k for k in KINDS if _given(getattr(self, k)))

    @property
    def spec(self) -> Any:
        """The constraint itself: the schema, the regex, the choices, the grammar (True for json_object)."""
        return getattr(self, self.kind)

    def key(self) -> str:
        """A canonical text of the whole spec: equal specs give equal keys (the compile cache's key)."""
        d: dict[str, Any] = {k: getattr(self, k) for k in _OPTIONS}
        d[self.kind] = self.spec  # not to_dict: no deep copy of the schema for every request's lookup
        return json.dumps(d, sort_keys=True, separators=(",", ":"), ensure_ascii=False)

    def check_limits(self, limits: StructuredLimits) -> None:
        """``ValueError`` naming the field when the spec is larger or deeper than ``limits`` allow."""
        kind = self.kind
        # Depth first: it is counted without recursion, and json.dumps of a hostile depth would raise.
        if kind == "json":
            depth = _depth(self.spec, limits.max_depth)
            if depth > limits.max_depth:
                raise ValueError(f"json: the schema nests deeper than {limits.max_depth} levels")
        if kind == "choice" and len(self.spec) > limits.max_choices:
            raise ValueError(f"choice: {len(self.spec)} choices; the limit is {limits.max_choices}")
        size = len(json.dumps(self.spec, separators=(",", ":"), ensure_ascii=False).encode("utf-8"))
        if size > limits.max_spec_bytes:
            raise ValueError(f"{kind}: the {kind} is {size} bytes; the limit is {limits.max_spec_bytes}")

    # -- (de)serialisation ----------------------------------------------------------------------

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> StructuredOutputsParams:
        """From the wire / a request body; an unknown key is a ``ValueError`` naming it."""
        if isinstance(d, StructuredOutputsParams):
            return d
        if not isinstance(d, Mapping):
            raise ValueError(f"structured_outputs must be an object, got {type(d).__name__}")
        unknown = sorted(str(k) for k in d if k not in cls.FIELDS)
        if unknown:
            raise ValueError(f"structured_outputs.{unknown[0]} is not a structured-outputs field "
                             f"(allowed: {', '.join(cls.FIELDS)})")
        return cls(**{k: v for k, v in d.items() if v is not None})

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: the one constraint that is set plus the two options;
        ``from_dict(p.to_dict()) == p``."""
        d: dict[str, Any] = {k: getattr(self, k) for k in _OPTIONS}
        # A copy: a caller editing the dict must not change these (frozen) params.
        d[self.kind] = list(self.spec) if self.kind == "choice" else copy.deepcopy(self.spec)
        return d


StructuredOutputsParams.FIELDS = tuple(f.name for f in fields(StructuredOutputsParams))


def _given(value: Any) -> bool:
    """Whether a constraint field is set: anything but None and False (``json_object=False`` is off)."""
    return value is not None and value is not False


def _depth(value: Any, limit: int) -> int:
    """Nesting depth of a JSON value (a scalar is 0), without recursion; stops counting past ``limit``."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        v, d = stack.pop()
        if d > limit:
            return d
        deepest = max(deepest, d)
        children = v.values() if isinstance(v, dict) else v if isinstance(v, list) else ()
        stack.extend((c, d + 1) for c in children if isinstance(c, (dict, list)))
    return deepest
