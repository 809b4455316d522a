"""Structured-output test data shared by the engine, queue and benchmark tests: JSON schemas, regexes,
choice lists and Lark / EBNF grammars, each with the check its outputs must pass.

The tests run tiny random models, whose unconstrained output is noise: only the constraint makes it
valid, and nothing makes it *end* but the grammar. So every case here has a bounded language or one
a random walk leaves quickly: free strings carry a ``maxLength``, arrays a ``maxItems``, numbers a
range (and a ``multipleOf`` where a fraction could otherwise run on), objects
``additionalProperties: false`` (an open object lets the model add keys forever). That is what makes
"every output completes and validates" achievable, and honest: nothing is retried or filtered.
Two cases keep an unbounded language on purpose (``UNBOUNDED``): a ``time`` / ``date-time``'s
fractional seconds and ``recursive_tree``'s depth. A random walk leaves them within a few tokens;
a real model under greedy decoding may not (SmolLM2-135M loops on both until ``max_tokens``), so
a benchmark or a real-model test should leave them out.

``check_output(params, text)`` raises ``AssertionError`` saying what is wrong; JSON is validated by
the ``jsonschema`` library (draft 2020-12) with its format checker, plus RFC 3339 ``time`` and
``date-time`` checks (jsonschema needs the optional rfc3339-validator package for those).
"""

from __future__ import annotations

import datetime
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jsonschema

from batchinfer.workers.structured_params import StructuredOutputsParams

_NAME = {"type": "string", "maxLength": 12}
_SMALL_INT = {"type": "integer", "minimum": 0, "maximum": 99}

#: name -> JSON schema (30 of them).
JSON_SCHEMAS: dict[str, dict[str, Any]] = {
    "flat_person": {
        "type": "object",
        "properties": {"name": _NAME, "age": {"type": "integer", "minimum": 0, "maximum": 130}},
        "required": ["name", "age"], "additionalProperties": False,
    },
    "nested_address": {
        "type": "object",
        "properties": {
            "name": _NAME,
            "address": {
                "type": "object",
                "properties": {"street": _NAME, "city": _NAME,
                               "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["street", "city", "zip"], "additionalProperties": False,
            },
        },
        "required": ["name", "address"], "additionalProperties": False,
    },
    "deep_nesting": {
        "type": "object",
        "properties": {"a": {"type": "object", "properties": {"b": {"type": "object", "properties": {
            "c": {"type": "object", "properties": {"d": {"type": "boolean"}},
                  "required": ["d"], "additionalProperties": False}},
            "required": ["c"], "additionalProperties": False}},
            "required": ["b"], "additionalProperties": False}},
        "required": ["a"], "additionalProperties": False,
    },
    "array_min_max": {
        "type": "array", "items": _SMALL_INT, "minItems": 2, "maxItems": 4,
    },
    "array_of_objects": {
        "type": "object",
        "properties": {"items": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
            "type": "object", "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{3}$"},
                                             "qty": {"type": "integer", "minimum": 1, "maximum": 50}},
            "required": ["sku", "qty"], "additionalProperties": False}}},
        "required": ["items"], "additionalProperties": False,
    },
    "exact_items": {"type": "array", "items": {"type": "boolean"}, "minItems": 3, "maxItems": 3},
    "string_enum": {
        "type": "object",
        "properties": {"sentiment": {"enum": ["positive", "negative", "neutral"]}},
        "required": ["sentiment"], "additionalProperties": False,
    },
    "mixed_enum": {"enum": ["red", 7, None, True, 2.5]},
    "const_fields": {
        "type": "object",
        "properties": {"version": {"const": 2}, "kind": {"const": "invoice"}, "ok": {"type": "boolean"}},
        "required": ["version", "kind", "ok"], "additionalProperties": False,
    },
    "integer_range": {"type": "integer", "minimum": -50, "maximum": 50},
    "integer_exclusive": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 1000},
    "number_range": {
        "type": "object",
        "properties": {"score": {"type": "number", "minimum": 0, "maximum": 1, "multipleOf": 0.125},
                       "temp": {"type": "number", "minimum": -40, "maximum": 60, "multipleOf": 0.5}},
        "required": ["score", "temp"], "additionalProperties": False,
    },
    "string_pattern": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
    "string_lengths": {"type": "string", "minLength": 2, "maxLength": 6},
    "format_date": {"type": "object", "properties": {"due": {"type": "string", "format": "date"}},
                    "required": ["due"], "additionalProperties": False},
    "format_time": {"type": "string", "format": "time"},
    "format_date_time": {"type": "string", "format": "date-time"},
    "format_uuid": {"type": "object", "properties": {"id": {"type": "string", "format": "uuid"}},
                    "required": ["id"], "additionalProperties": False},
    "format_ipv4": {"type": "array", "items": {"type": "string", "format": "ipv4"},
                    "minItems": 1, "maxItems": 2},
    "format_ipv6": {"type": "string", "format": "ipv6"},
    "optional_props": {
        "type": "object",
        "properties": {"id": _SMALL_INT, "note": {"type": "string", "maxLength": 8},
                       "flag": {"type": "boolean"}, "tag": {"enum": ["x", "y"]}},
        "required": ["id"], "additionalProperties": False,
    },
    "all_optional": {
        "type": "object",
        "properties": {"a": {"type": "boolean"}, "b": {"type": "null"}},
        "additionalProperties": False,
    },
    "any_of": {
        "anyOf": [
            {"type": "object", "properties": {"cat": {"const": "a"}, "n": _SMALL_INT},
             "required": ["cat", "n"], "additionalProperties": False},
            {"type": "object", "properties": {"cat": {"const": "b"}, "s": {"type": "string", "maxLength": 5}},
             "required": ["cat", "s"], "additionalProperties": False},
        ],
    },
    "any_of_scalars": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "boolean"},
                                 {"type": "null"}]},
    "nullable_type": {
        "type": "object",
        "properties": {"middle": {"type": ["string", "null"], "maxLength": 6}},
        "required": ["middle"], "additionalProperties": False,
    },
    "refs_defs": {
        "$defs": {
            "point": {"type": "object", "properties": {"x": _SMALL_INT, "y": _SMALL_INT},
                      "required": ["x", "y"], "additionalProperties": False},
        },
        "type": "object",
        "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}},
        "required": ["start", "end"], "additionalProperties": False,
    },
    "recursive_tree": {
        "$defs": {
            "node": {"type": "object",
                     "properties": {"v": {"type": "integer", "minimum": 0, "maximum": 9},
                                    "kids": {"type": "array", "items": {"$ref": "#/$defs/node"},
                                             "maxItems": 2}},
                     "required": ["v"], "additionalProperties": False},
        },
        "$ref": "#/$defs/node",
    },
    "tuple_prefix_items": {
        "type": "array",
        "prefixItems": [{"type": "string", "maxLength": 4}, {"type": "integer", "minimum": 0, "maximum": 9},
                        {"type": "boolean"}],
        "items": False, "minItems": 3,
    },
    "extraction": {
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 16},
            "year": {"type": "integer", "minimum": 1900, "maximum": 2030},
            "authors": {"type": "array", "items": _NAME, "minItems": 1, "maxItems": 3},
            "language": {"enum": ["en", "de", "fr", "es"]},
            "open_access": {"type": "boolean"},
            "doi": {"type": "string", "pattern": "^10\\.[0-9]{4}/[a-z0-9]{1,8}$"},
        },
        "required": ["title", "year", "authors", "language"], "additionalProperties": False,
    },
    "nested_arrays": {
        "type": "array", "minItems": 1, "maxItems": 3,
        "items": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 3},
    },
}

_OCTET = r"(25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])"

#: JSON_SCHEMAS whose language is unbounded (see the module docstring).
UNBOUNDED = frozenset({"format_time", "format_date_time", "recursive_tree"})

#: name -> regex (the whole output must match it). ``[0-9]``, not ``\d``: both Rust's regex crate and
#: Python's ``re`` read ``\d`` as any Unicode digit, from Unicode tables of different versions.
REGEX_CASES: dict[str, str] = {
    "phone": r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}",
    "slug": r"[a-z]{2,8}(-[a-z]{2,8}){0,2}",
    "hex_color": r"#[0-9a-fA-F]{6}",
    "ipv4ish": rf"{_OCTET}(\.{_OCTET}){{3}}",
    "yes_no_reason": r"(yes|no): [a-z ]{1,12}\.",
}

#: name -> the choices (the output is exactly one of them).
CHOICE_CASES: dict[str, list[str]] = {
    "sentiment": ["positive", "negative", "neutral"],
    "prefixes": ["a", "ab", "abc", "b"],  # one choice a prefix of another: the model picks where to stop
    "punctuated": ["C++", "C#", "F*", "(none)", "a.b|c"],  # regex metacharacters stay literal
}


def _balanced_sum(text: str) -> bool:
    """The language of the ``sum`` grammars: integers joined by + or *, parentheses balanced."""
    depth, prev = 0, "("  # what came before: "(" / an operator (an operand must follow) or "d"
    for ch in text:
        if ch.isdigit():
            if prev == ")":
                return False
            prev = "d"
        elif ch in "+*":
            if prev not in ("d", ")"):
                return False
            prev = "op"
        elif ch == "(":
            if prev in ("d", ")"):
                return False
            depth, prev = depth + 1, "("
        elif ch == ")":
            if prev not in ("d", ")") or depth == 0:
                return False
            depth, prev = depth - 1, ")"
        else:
            return False
    return depth == 0 and prev in ("d", ")")


#: name -> (grammar text, a check of its language). Lark grammars have ``start:``; EBNF (GBNF) ``::=``.
GRAMMAR_CASES: dict[str, tuple[str, Callable[[str], bool]]] = {
    "lark_kv_list": (
        'start: pair (";" pair){0,2}\n'
        'pair: KEY "=" VALUE\n'
        'KEY: /[a-z]{1,6}/\n'
        'VALUE: /[0-9]{1,3}/\n',
        lambda s: re.fullmatch(r"[a-z]{1,6}=[0-9]{1,3}(;[a-z]{1,6}=[0-9]{1,3}){0,2}", s) is not None,
    ),
    "lark_sum": (
        'start: expr\n'
        'expr: term (("+" | "*") term){0,3}\n'
        'term: NUM | "(" expr ")"\n'
        'NUM: /[0-9]{1,2}/\n',
        _balanced_sum,
    ),
    "ebnf_greeting": (
        'root ::= greeting " " name "!"\n'
        'greeting ::= "hello" | "hi" | "hey"\n'
        'name ::= [a-z] [a-z]? [a-z]? [a-z]?\n',
        lambda s: re.fullmatch(r"(hello|hi|hey) [a-z]{1,4}!", s) is not None,
    ),
    "ebnf_sum": (
        'root ::= expr\n'
        'expr ::= term (("+" | "*") term)?\n'
        'term ::= num | "(" expr ")"\n'
        'num ::= [0-9] [0-9]?\n',
        _balanced_sum,
    ),
}


@dataclass(frozen=True)
class Case:
    """One constraint and its name (``json:flat_person``, ``regex:phone``, ...)."""

    name: str
    params: StructuredOutputsParams


def all_cases() -> list[Case]:
    """Every case above, JSON schemas first."""
    cases = [Case(f"json:{k}", StructuredOutputsParams(json=v)) for k, v in JSON_SCHEMAS.items()]
    cases += [Case(f"regex:{k}", StructuredOutputsParams(regex=v)) for k, v in REGEX_CASES.items()]
    cases += [Case(f"choice:{k}", StructuredOutputsParams(choice=v)) for k, v in CHOICE_CASES.items()]
    cases += [Case(f"grammar:{k}", StructuredOutputsParams(grammar=g)) for k, (g, _) in GRAMMAR_CASES.items()]
    return cases


# -- checking -------------------------------------------------------------------------------------

_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_FULL_TIME = re.compile(r"([0-9]{2}):([0-9]{2}):([0-9]{2})(\.[0-9]+)?([Zz]|[+-]([0-9]{2}):([0-9]{2}))")


def _is_time(value: object) -> bool:
    """RFC 3339 ``full-time``: ``HH:MM:SS[.frac](Z|+HH:MM)`` with valid fields (a leap second allowed)."""
    if not isinstance(value, str):
        return True  # formats apply to strings only
    m = _FULL_TIME.fullmatch(value)
    if m is None:
        return False
    h, mi, s = int(m[1]), int(m[2]), int(m[3])
    if m[6] is not None and (int(m[6]) > 23 or int(m[7]) > 59):
        return False
    return h <= 23 and mi <= 59 and s <= 60


def _is_date_time(value: object) -> bool:
    """RFC 3339 ``date-time``: a full-date, ``T`` (or ``t``), a full-time."""
    if not isinstance(value, str):
        return True
    date, sep, time = value.partition("T") if "T" in value else value.partition("t")
    if not sep:
        return False
    try:
        datetime.date.fromisoformat(date)
    except ValueError:
        return False
    return len(date) == 10 and _is_time(time)


FORMAT_CHECKER = jsonschema.FormatChecker(jsonschema.Draft202012Validator.FORMAT_CHECKER.checkers)
FORMAT_CHECKER.checks("time")(_is_time)
FORMAT_CHECKER.checks("date-time")(_is_date_time)


def check_output(params: StructuredOutputsParams, text: str) -> None:
    """``AssertionError`` saying how ``text`` fails ``params``; nothing when it is a valid output."""
    kind, spec = params.kind, params.spec
    if kind in ("json", "json_object"):
        try:
            value = json.loads(text)
        except ValueError as e:
            raise AssertionError(f"not JSON ({e}): {text!r}") from None
        schema = {"type": "object"} if kind == "json_object" else spec
        validator = jsonschema.Draft202012Validator(schema, format_checker=FORMAT_CHECKER)
        errors = list(validator.iter_errors(value))
        assert not errors, f"{text!r} fails its schema: {errors[0].message}"
        if params.disable_any_whitespace:  # compact JSON: whitespace only inside strings
            outside = _JSON_STRING.sub('""', text)
            assert not re.search(r"\s", outside), f"whitespace outside strings in compact JSON: {text!r}"
    elif kind == "regex":
        assert re.fullmatch(spec, text) is not None, f"{text!r} does not match /{spec}/"
    elif kind == "choice":
        assert text in spec, f"{text!r} is not one of {list(spec)}"
    else:
        matches = next((chk for g, chk in GRAMMAR_CASES.values() if g == spec), None)
        assert matches is not None, "a grammar that is not one of GRAMMAR_CASES has no check"
        assert matches(text), f"{text!r} is not in the language of the grammar"
