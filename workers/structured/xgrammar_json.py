"""Where xgrammar 0.2.9's JSON handling falls short, and how the xgrammar backend makes up for it.

Each gap was probed (a violating output passes its matcher); llguidance has none of them:

- JSON-schema keywords it accepts without enforcing (``not``, ``if``, ``uniqueItems``,
  ``contains``, ``allOf`` of several schemas, ``multipleOf`` on a number, ``maxLength`` beside a
  ``pattern``, ...): :func:`check_enforceable` refuses the schema with a ``StructuredOutputError``,
  as llguidance says "Unimplemented keys": ignoring one would let outputs through that the schema
  rejects;
- a ``format`` it checks loosely (``ipv4`` with leading zeros): :func:`strict_formats` rewrites it
  as the equivalent ``pattern``;
- token masks that let through raw control characters in a ``maxLength`` string and UTF-16
  surrogates in any string: :func:`json_text_filter`, the tokens a JSON matcher refuses and the
  mask words its rows are ANDed with.

Pure functions of schemas and token bytes: nothing here imports xgrammar.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass
from typing import Any

import numpy as np

from batchinfer.workers.structured.backend import StructuredOutputError, walk_schema

# JSON-schema keywords xgrammar 0.2.9 accepts but does not enforce (probed: a violating output
# passes its matcher); llguidance rejects them as "Unimplemented keys" too.
_UNENFORCED = ("not", "if", "then", "else", "dependentRequired", "dependentSchemas", "dependencies",
               "contains", "minContains", "maxContains", "unevaluatedProperties", "unevaluatedItems")


@dataclass(frozen=True)
class JsonTextFilter:
    """Tokens a JSON output must not take whatever xgrammar's mask says (see
    :func:`json_text_filter`): ``banned`` never, ``continuations`` not right after a token
    that ends in the byte 0xED (``ends_ed``). The ``keep`` words are the mask words without them."""

    banned: frozenset[int]
    keep: np.ndarray  # int32 [W]
    ends_ed: frozenset[int]
    continuations: frozenset[int]
    keep_after_ed: np.ndarray  # int32 [W]: without banned nor continuations


def json_text_filter(decoded: list[bytes], vocab_size: int, whitespace: bool) -> JsonTextFilter:
    """What JSON matchers refuse beyond xgrammar's masks, which 0.2.9 gets wrong in two ways
    (probed; each lets through text no JSON parser reads as the schema says):

    - a raw control character (U+0000-U+001F) in a length-bounded string (``maxLength``):
      ``"\x1c"``. JSON text never holds one (tab, newline and carriage return stay allowed
      between values when ``whitespace``): tokens holding one are refused;
    - a UTF-16 surrogate (U+D800-U+DFFF, bytes ED A0-BF ..) in any string: invalid UTF-8, which
      decodes to U+FFFD. Tokens holding ED A0-BF are refused, and after a token that ends in ED
      so are tokens starting with A0-BF."""
    allowed = {9, 10, 13} if whitespace else set()
    surrogate = re.compile(b"\xed[\xa0-\xbf]")
    banned = frozenset(t for t, piece in enumerate(decoded) if surrogate.search(piece)
                       or any(c < 0x20 and c not in allowed for c in piece))
    continuations = frozenset(t for t, piece in enumerate(decoded) if piece[:1] and 0xA0 <= piece[0] <= 0xBF)
    ends_ed = frozenset(t for t, piece in enumerate(decoded) if piece.endswith(b"\xed"))
    keep = _words_without(banned, vocab_size)
    keep_after_ed = keep & _words_without(continuations, vocab_size)
    return JsonTextFilter(banned, keep, ends_ed, continuations, keep_after_ed)


def _words_without(tokens: frozenset[int], vocab_size: int) -> np.ndarray:
    """int32 [W]: mask words allowing every token of the vocabulary but ``tokens``."""
    words = np.full((vocab_size + 31) // 32, -1, dtype=np.int32)
    for t in tokens:
        words[t // 32] &= ~np.int32(-(2**31) if t % 32 == 31 else 1 << (t % 32))
    return words


def check_enforceable(schema: Any) -> None:
    """``StructuredOutputError`` naming the first keyword (and where) that xgrammar would accept
    without enforcing it (see the module docstring)."""
    for where, node in walk_schema(schema):
        problem = _unenforced(node, where)
        if problem:
            raise StructuredOutputError(f"json: {problem}")


def _unenforced(node: dict[str, Any], where: str) -> str | None:
    """What in one subschema xgrammar 0.2.9 ignores (each case probed: it warns, or a violating
    output passes), or None."""
    unsupported = " is not supported by the xgrammar backend (it would not be enforced)"
    for key in _UNENFORCED:
        if key in node:
            return f"the keyword {key!r} at {where}{unsupported}"
    if node.get("uniqueItems") is True:
        return f"the keyword 'uniqueItems' at {where}{unsupported}"
    all_of = node.get("allOf")
    if isinstance(all_of, list) and len(all_of) > 1:
        return f"'allOf' with {len(all_of)} schemas at {where}{unsupported}"
    if "multipleOf" in node and node.get("type") != "integer":
        return f"'multipleOf' on a non-integer at {where}{unsupported}"
    lengths = [k for k in ("minLength", "maxLength") if k in node]
    if lengths and ("pattern" in node or "format" in node):
        other = "pattern" if "pattern" in node else "format"
        return f"{lengths[0]!r} together with {other!r} at {where}{unsupported}"
    required, props = node.get("required"), node.get("properties")
    if (isinstance(required, list) and node.get("additionalProperties") is False
            and "patternProperties" not in node):
        missing = [r for r in required if not isinstance(props, dict) or r not in props]
        if missing:  # xgrammar drops the requirement; llguidance calls it unsatisfiable
            return (f"the required property {missing[0]!r} at {where} is not among the properties of "
                    f"a closed object: the schema matches no value")
    return None


_OCTET = "(25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])"
# Formats xgrammar 0.2.9 checks more loosely than JSON Schema (its ipv4 takes "088.1.1.1"), as the
# patterns that say exactly what the format does (RFC 2673 dotted quads: no leading zeros).
_FORMAT_PATTERNS = {"ipv4": f"^({_OCTET}\\.){{3}}{_OCTET}$"}


def strict_formats(schema: Any) -> Any:
    """``schema`` with each ``format`` of ``_FORMAT_PATTERNS`` (and no ``pattern`` of its own)
    replaced by its pattern; a copy when anything changes."""
    if not any(node.get("format") in _FORMAT_PATTERNS for _, node in walk_schema(schema)):
        return schema
    schema = copy.deepcopy(schema)
    for _, node in walk_schema(schema):
        if node.get("format") in _FORMAT_PATTERNS and "pattern" not in node:
            node["pattern"] = _FORMAT_PATTERNS[node.pop("format")]
    return schema
