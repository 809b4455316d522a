"""Compact JSON for the hot paths of the wire format: result rows and batch entries, written.

``orjson`` encodes a result row 5-20x faster than ``json.dumps`` (docs/benchmarks.md, "Queue
overhead"), and every row of every job is encoded once on the worker, next to its engine. Its
output holds the same values as the standard library's compact form (``separators=(",", ":")``,
``ensure_ascii=False``), a float may be spelled differently (``1e-9`` for ``1e-09``, ``0.00001`` for
``1e-05``: the same double), and one value differs: a float that is not finite (none is expected in
a row) is written as ``null``, which JSON has, rather than ``-Infinity``, which it has not. What
orjson refuses (a lone surrogate, an int beyond 64 bits, a type it does not know) is encoded by
``json`` as before, so nothing that encoded before fails now.

Reading stays with ``json.loads`` here: orjson reads an integer past 64 bits as a float, where
the protocol needs the exact value or a clear error. A worker's batch entries are read through
orjson where that cannot happen (:func:`batchinfer.protocol.batches.loads`).
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
