"""Row filters: a small SQL-like ``--where`` language parsed by hand (no eval) into pyarrow expressions.

Grammar (keywords in any case; NOT binds tighter than AND, AND tighter than OR)::

    expr      := term (OR term)*
    term      := factor (AND factor)*
    factor    := NOT factor | '(' expr ')' | predicate
    predicate := column ('=' | '!=' | '<>' | '<' | '<=' | '>' | '>=') literal
               | column [NOT] IN '(' literal (',' literal)* ')'
               | column IS [NOT] NULL
    column    := bare_name | "double quoted" ("" inside is one ")
    literal   := 'text' ('' inside is one ') | number | TRUE | FALSE
               | DATE 'YYYY-MM-DD' | TIMESTAMP 'YYYY-MM-DD HH:MM:SS[.ffffff][+HH:MM]'

A literal is cast to its column's type when the expression is built (:meth:`RowFilter.expression`),
so ``date = '2026-12-03'`` works on a Hive partition typed string and on a date32 column alike, and
``year = 2026`` on an int32 partition. Comparisons follow SQL: a null cell matches nothing but
``IS NULL``.
"""

from __future__ import annotations

import datetime as dt
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

_KEYWORDS = frozenset({"AND", "OR", "NOT", "IN", "IS", "NULL", "TRUE", "FALSE", "DATE", "TIMESTAMP"})
_SOFT_KEYWORDS = frozenset({"DATE", "TIMESTAMP"})  # also column names, bare, where a column goes
_OPERATORS = ("<=", ">=", "!=", "<>", "=", "<", ">", "(", ")", ",")
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.]*")
_NUMBER = re.compile(r"-?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?")
# Tree nodes are tuples (hashable, comparable): ("or"|"and", left, right), ("not", node),
# ("cmp", op, column, literal), ("in", column, literals, negated), ("null", column, negated);
# a literal is (kind, value) with kind in str | int | float | bool | date | timestamp.
Node = tuple


@dataclass(frozen=True)
class _Token:
    kind: str  # name | keyword | string | number | op | end
    text: str  # the value (unquoted for strings and quoted names; upper case for keywords)
    pos: int  # 0-based offset in the filter text
    raw: str = ""  # a keyword as written (DATE and TIMESTAMP also name columns)


def _error(text: str, pos: int, what: str) -> ValueError:
    near = repr(text[pos:pos + 20]) if pos < len(text) else "the end"
    return ValueError(f"bad filter {text!r}: {what} at position {pos + 1} (near {near})")


def _quoted(text: str, pos: int, quote: str) -> tuple[str, int]:
    """The content of a quoted run starting at ``pos`` (a doubled quote is one), and the offset after it."""
    out, i = [], pos + 1
    while i < len(text):
        if text[i] == quote:
            if text[i + 1:i + 2] == quote:
                out.append(quote)
                i += 2
                continue
            return "".join(out), i + 1
        out.append(text[i])
        i += 1
    raise _error(text, pos, f"unclosed {quote}")


def _tokens(text: str) -> list[_Token]:
    tokens, i = [], 0
    while i < len(text):
        ch = text[i]
        if ch.isspace():
            i += 1
        elif ch in "'\"":
            value, end = _quoted(text, i, ch)
            tokens.append(_Token("string" if ch == "'" else "name", value, i))
            i = end
        elif number := _NUMBER.match(text, i):
            tokens.append(_Token("number", number.group(), i))
            i = number.end()
        elif name := _NAME.match(text, i):
            word = name.group()
            upper = word.upper()
            keyword = upper in _KEYWORDS
            tokens.append(_Token("keyword", upper, i, word) if keyword else _Token("name", word, i))
            i = name.end()
        else:
            op = next((op for op in _OPERATORS if text.startswith(op, i)), None)
            if op is None:
                raise _error(text, i, f"unexpected character {ch!r}")
            tokens.append(_Token("op", op, i))
            i += len(op)
    tokens.append(_Token("end", "", len(text)))
    return tokens


class _Parser:
    """Recursive descent over the tokens, one method per grammar rule."""

    def __init__(self, text: str):
        self.text = text
        self.tokens = _tokens(text)
        self.i = 0
        self.columns: set[str] = set()

    def peek(self) -> _Token:
        return self.tokens[self.i]

    def take(self) -> _Token:
        token = self.tokens[self.i]
        self.i += 1
        return token

    def accept(self, kind: str, text: str) -> bool:
        token = self.peek()
        if token.kind == kind and token.text == text:
            self.i += 1
            return True
        return False

    def expect(self, kind: str, text: str, what: str) -> None:
        if not self.accept(kind, text):
            raise self.fail(what)

    def fail(self, what: str) -> ValueError:
        return _error(self.text, self.peek().pos, f"expected {what}")

    def parse(self) -> Node:
        if self.peek().kind == "end":
            raise self.fail("a condition")
        node = self.expr()
        if self.peek().kind != "end":
            raise self.fail("AND, OR or the end")
        return node

    def expr(self) -> Node:
        node = self.term()
        while self.accept("keyword", "OR"):
            node = ("or", node, self.term())
        return node

    def term(self) -> Node:
        node = self.factor()
        while self.accept("keyword", "AND"):
            node = ("and", node, self.factor())
        return node

    def factor(self) -> Node:
        if self.accept("keyword", "NOT"):
            return ("not", self.factor())
        if self.accept("op", "("):
            node = self.expr()
            self.expect("op", ")", "')'")
            return node
        return self.predicate()

    def predicate(self) -> Node:
        token = self.take()
        if token.kind == "keyword" and token.text in _SOFT_KEYWORDS:
            column = token.raw  # `date = '2026-12-03'`: DATE starts a literal only where a value goes
        elif token.kind == "name":
            column = token.text
        else:
            self.i -= 1
            raise self.fail("a column name (quote a name that is a keyword: \"in\")")
        self.columns.add(column)
        token = self.peek()
        if token.kind == "op" and token.text in ("=", "!=", "<>", "<", "<=", ">", ">="):
            self.i += 1
            return ("cmp", "!=" if token.text == "<>" else token.text, column, self.literal())
        if self.accept("keyword", "IS"):
            negated = self.accept("keyword", "NOT")
            self.expect("keyword", "NULL", "NULL")
            return ("null", column, negated)
        negated = self.accept("keyword", "NOT")
        if self.accept("keyword", "IN"):
            self.expect("op", "(", "'(' after IN")
            values = [self.literal()]
            while self.accept("op", ","):
                values.append(self.literal())
            self.expect("op", ")", "')' or ','")
            return ("in", column, tuple(values), negated)
        raise self.fail("IN after NOT" if negated else "a comparison (=, !=, <, <=, >, >=, IN, IS NULL)")

    def literal(self) -> tuple[str, Any]:
        token = self.take()
        if token.kind == "string":
            return ("str", token.text)
        if token.kind == "number":
            is_float = any(c in token.text for c in ".eE")
            return ("float", float(token.text)) if is_float else ("int", int(token.text))
        if token.kind == "keyword" and token.text in ("TRUE", "FALSE"):
            return ("bool", token.text == "TRUE")
        if token.kind == "keyword" and token.text in ("DATE", "TIMESTAMP"):
            value = self.take()
            if value.kind != "string":
                self.i -= 1
                raise self.fail(f"a quoted text after {token.text}")
            try:
                if token.text == "DATE":
                    return ("date", dt.date.fromisoformat(value.text))
                return ("timestamp", dt.datetime.fromisoformat(value.text))
            except ValueError:
                raise _error(self.text, value.pos, f"not a valid {token.text}: {value.text!r}") from None
        self.i -= 1
        if token.kind == "keyword" and token.text == "NULL":
            raise self.fail("a value (compare with NULL through IS NULL / IS NOT NULL)")
        raise self.fail("a value ('text', a number, TRUE, FALSE, DATE '...', TIMESTAMP '...')")


def _field_type(schema: pa.Schema, column: str) -> pa.DataType:
    index = schema.get_field_index(column)
    if index < 0:
        raise ValueError(f"the filter names column {column!r}, which the data does not have "
                         f"(columns: {', '.join(schema.names)})")
    kind = schema.field(index).type
    return kind.value_type if pa.types.is_dictionary(kind) else kind


def _scalar(literal: tuple[str, Any], column: str, kind: pa.DataType) -> pa.Scalar:
    """The literal as a scalar of the column's type (pyarrow's casts: '2026-12-03' -> date32,
    '2026' -> int32, 42 -> '42'); a number that does not fit a numeric column stays as it is (pyarrow
    then compares 1.5 with an int column exactly)."""
    value = pa.scalar(literal[1])
    try:
        return value.cast(kind)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError):
        if literal[0] in ("int", "float") and (pa.types.is_integer(kind) or pa.types.is_floating(kind)):
            return value
        raise ValueError(f"the filter compares column {column!r} ({kind}) with {literal[1]!r}, "
                         f"which cannot be read as {kind}") from None


def _build(node: Node, schema: pa.Schema) -> pc.Expression:
    tag = node[0]
    if tag in ("or", "and"):
        left, right = _build(node[1], schema), _build(node[2], schema)
        return left | right if tag == "or" else left & right
    if tag == "not":
        return ~_build(node[1], schema)
    if tag == "null":
        _field_type(schema, node[1])
        return pc.is_valid(pc.field(node[1])) if node[2] else pc.is_null(pc.field(node[1]))
    column = node[2] if tag == "cmp" else node[1]
    kind = _field_type(schema, column)
    if tag == "in":
        scalars = [_scalar(v, column, kind) for v in node[2]]
        types = {s.type for s in scalars}  # one type unless a number did not fit the column's
        values = pa.array([s.as_py() for s in scalars], type=types.pop() if len(types) == 1 else None)
        member = pc.field(column).isin(values)  # false, not null, for a null cell: SQL wants null
        return (~member & pc.is_valid(pc.field(column))) if node[3] else member
    compare = {"=": pc.equal, "!=": pc.not_equal, "<": pc.less, "<=": pc.less_equal, ">": pc.greater,
               ">=": pc.greater_equal}[node[1]]
    return compare(pc.field(column), _scalar(node[3], column, kind))


@dataclass(frozen=True)
class RowFilter:
    """A parsed --where: col = | != | <> | < | <= | > | >= literal, col [NOT] IN (lit, ...),
    col IS [NOT] NULL, AND, OR, NOT, parentheses; literals 'text' ('' escapes '), numbers,
    TRUE/FALSE, DATE 'YYYY-MM-DD', TIMESTAMP '...'; identifiers bare or "double quoted"."""

    text: str
    columns: frozenset[str]
    _tree: Node = field(repr=False)

    @classmethod
    def parse(cls, text: str) -> RowFilter:
        """Parse ``text``; ValueError naming the (1-based) position on bad syntax."""
        parser = _Parser(text)
        tree = parser.parse()
        return cls(text=text, columns=frozenset(parser.columns), _tree=tree)

    def expression(self, schema: pa.Schema) -> pc.Expression:
        """The filter as a pyarrow expression over ``schema``, each literal cast to its column's type.
        ValueError naming an unknown column (listing the columns) or a literal the column's type
        cannot hold."""
        return _build(self._tree, schema)

    def __and__(self, other: RowFilter) -> RowFilter:
        return RowFilter(text=f"({self.text}) AND ({other.text})", columns=self.columns | other.columns,
                         _tree=("and", self._tree, other._tree))


def _quote_name(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def _quote_text(value: str) -> str:
    return "'" + value.replace("'", "''") + "'"


def partition_filter(pairs: Sequence[str]) -> RowFilter | None:
    """The filter ``--partition KEY=VALUE ...`` asks for: equalities ANDed, a key given twice
    becomes ``IN`` (either value). None when ``pairs`` is empty; ValueError for a pair without '='.
    Values are text, cast to the partition's type like any literal ('2026' matches an int32 year)."""
    by_key: dict[str, list[str]] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--partition {pair!r} is not KEY=VALUE (e.g. date=2026-12-03)")
        values = by_key.setdefault(key.strip(), [])
        if value not in values:
            values.append(value)
    if not by_key:
        return None
    parts = [f"{_quote_name(k)} = {_quote_text(v[0])}" if len(v) == 1
             else f"{_quote_name(k)} IN ({', '.join(_quote_text(x) for x in v)})" for k, v in by_key.items()]
    return RowFilter.parse(" AND ".join(parts))
