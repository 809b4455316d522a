"""JSON on the hot paths of the wire format: result rows and batch entries written compact, request
bodies and batch entries read.

``orjson`` encodes a result row 5-20x faster than ``json.dumps`` (docs/benchmarks.md, "Queue
overhead"), and every row of every job is encoded once on the worker, next to its engine. Its
output holds the same values as the standard library's compact form (``separators=(",", ":")``,
``ensure_ascii=False``), a float may be spelled differently (``1e-9`` for ``1e-09``, ``0.00001`` for
``1e-05``: the same double), and one value differs: a float that is not finite (none is expected in
a row) is written as ``null``, which JSON has, rather than ``-Infinity``, which it has not. What
orjson refuses (a lone surrogate, an int beyond 64 bits, a type it does not know) is encoded by
``json`` as before, so nothing that encoded before fails now.

Reading (:func:`loads`) goes through orjson only where it gives ``json.loads``'s values: orjson
reads an integer past 64 bits as a float, where the protocol needs the exact value or a clear
error, so such text is read by ``json``, as is all that orjson refuses.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import orjson


def dumps(value: Any, default: Callable[[Any], Any] | None = None) -> str:
    """``value`` as compact JSON text (non-ASCII characters kept as they are).

    orjson encodes a dataclass natively, its fields in order; ``default`` is what ``json`` calls,
    when it encodes what orjson refused, for an object it does not know (``fields_dict`` for a
    dataclass)."""
    try:
        return orjson.dumps(value).decode("utf-8")
    except (orjson.JSONEncodeError, TypeError):
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False, default=default)


# 19 digits in a row may be an integer orjson would read as a float (past 64 bits). Found as 19
# zeros once every digit is a zero: ``bytes.translate`` and a substring search run at C speed,
# where a regular expression cost more than orjson saves.
_DIGITS_TO_ZERO = bytes.maketrans(b"123456789", b"000000000")
_LONG_RUN = b"0" * 19


def loads(raw: bytes | str, **json_options: Any) -> Any:
    """JSON text as ``json.loads(raw, **json_options)`` reads it, through orjson where that gives
    the same values.

    Every request's body is read at intake, staged, and read again by its worker (token ids are
    most of it): orjson reads them 2-3x faster. It differs from ``json`` in what it refuses
    (``NaN``, a number past a double's range, a lone surrogate, nesting past 1,024: ``json`` reads
    those or refuses them with its own message, and ``json_options`` such as ``parse_constant``
    apply there) and in an integer past 64 bits, which it reads as a float: text holding 19 digits
    in a row goes to ``json`` whole (rare, and then only slower). One difference stays: orjson
    reads nesting up to 1,024 levels where ``json`` raises ``RecursionError`` near the interpreter's
    recursion limit; a caller reading untrusted text bounds the nesting first (``bodies.py``)."""
    text = raw.encode("utf-8", "surrogatepass") if isinstance(raw, str) else raw
    if _LONG_RUN not in text.translate(_DIGITS_TO_ZERO):
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError:
            pass
    return json.loads(raw, **json_options)
