"""The ``pythonic`` format (Llama 3.2 / 4 with vLLM's pythonic templates, ToolACE): the whole
output is a Python list of calls with keyword arguments,

    [get_weather(city="Paris", unit="celsius"), get_time(zone="Europe/Paris")]

read with :mod:`ast` (literals only: strings, numbers, booleans, None, lists, dicts; JSON's
``true`` / ``false`` / ``null`` too), never evaluated. ``<|python_start|>`` / ``<|python_end|>``
around it (Llama 4) are dropped. A call has no content beside it.
"""

from __future__ import annotations

import ast
import math
import re
from typing import Any

from batchinfer.workers.tools.parsed import MalformedToolCall, Parsed, ParsedCall

_WRAPPERS = ("<|python_start|>", "<|python_end|>", "<|python_tag|>")
_STARTS_CALL = re.compile(r"\[\s*[A-Za-z_]\w*\s*\(")
_JSON_NAMES = {"true": True, "false": False, "null": None}


def parse(text: str) -> Parsed | None:
    """The calls in ``text``; None when it is not a bracketed list that starts with a call."""
    body = text.strip()
    for wrapper in _WRAPPERS:
        body = body.replace(wrapper, "")
    body = body.strip()
    if not (_STARTS_CALL.match(body) and body.endswith("]")):
        return None
    try:
        tree = ast.parse(body, mode="eval").body
        if not isinstance(tree, ast.List):
            raise MalformedToolCall("not a Python list of calls")
        return None, [_call(node) for node in tree.elts]
    except SyntaxError as e:  # the parser's nesting limit included ("too many nested parentheses")
        raise MalformedToolCall(f"not a Python list of calls: {e.msg}") from None
    except RecursionError:
        raise MalformedToolCall("literal nested too deeply") from None


def _call(node: ast.expr) -> ParsedCall:
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
        raise MalformedToolCall(f"not a call of a function name: {ast.unparse(node)[:60]!r}")
    name = node.func.id
    if node.args:
        raise MalformedToolCall(f"{name}: arguments must be given by keyword")
    args: dict[str, Any] = {}
    for kw in node.keywords:
        if kw.arg is None:
            raise MalformedToolCall(f"{name}: **kwargs are not a literal argument")
        args[kw.arg] = _literal(kw.value)
    return name, args


def _literal(node: ast.expr) -> Any:
    """A JSON value from a literal expression; ``MalformedToolCall`` for anything else."""
    if isinstance(node, ast.Constant) and (node.value is None
                                           or isinstance(node.value, (str, bool, int, float))):
        if isinstance(node.value, float) and not math.isfinite(node.value):
            raise MalformedToolCall("a non-finite number is not JSON")
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _literal(node.operand)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise MalformedToolCall("a sign before something other than a number")
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        out = {}
        for k, v in zip(node.keys, node.values, strict=True):
            key = _literal(k) if k is not None else None
            if not isinstance(key, str):
                raise MalformedToolCall("dict keys must be strings")
            out[key] = _literal(v)
        return out
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    raise MalformedToolCall(f"not a literal: {ast.unparse(node)[:60]!r}")
