"""Request templates: a dataset row in, a request body out (sandboxed jinja2).

A *prompt* template renders the prompt text, which becomes the body a model takes (``prompt_as``):
``{"messages": [{"role": "user", "content": text}]}`` for a chat model (its chat template wraps it),
``{"prompt": text}`` for a base model, ``{"input": text}`` for an embedding model. A *body* template
renders a whole JSON request body (messages, sampling fields, ``response_format``).

The row's columns are the template's variables. Templates run in jinja2's immutable sandbox (no
attribute starting with ``_``, no mutation) with strict undefined variables, so a mistake fails
loudly per row (:class:`RowError`: the client turns it into an error row naming the file and row)
instead of sending a prompt with a hole in it:

- a null cell is left out of the variables: ``{{ x }}`` fails "column 'x' is null", while
  ``{{ x | default('') }}`` and ``{% if x is defined %}`` work;
- a variable that is no column fails "no column 'x' (columns: ...)";
- a list, dict or bytes value printed as it is fails: write it with ``| tojson`` or ``| join``;
- ``tojson`` is plain ``json.dumps`` (no HTML escaping, non-ASCII kept); dates, timestamps and
  decimals are written as their ISO / decimal text.
"""

from __future__ import annotations

import datetime
import decimal
import functools
import json
import json.encoder
import traceback
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import jinja2
import jinja2.meta
import jinja2.nodes
from jinja2.exceptions import SecurityError, TemplateSyntaxError, UndefinedError
from jinja2.sandbox import ImmutableSandboxedEnvironment

__all__ = ["KINDS", "PROMPT_AS", "RequestTemplate", "RowError", "TemplateError"]

KINDS = ("prompt", "body")
PROMPT_AS = ("auto", "messages", "prompt", "input")


class TemplateError(ValueError):
    """A template unusable as a whole (unreadable, bad syntax): ``"t.jinja line 3: unexpected '}'"``."""


class RowError(ValueError):
    """One row's rendering failed; the message names the column or the template line."""


class _Undefined(jinja2.StrictUndefined):
    """StrictUndefined whose failure for a plain variable says which one, so that render can tell a
    null cell from a column that does not exist."""

    __slots__ = ()

    def __init__(self, hint: str | None = None, obj: Any = jinja2.utils.missing, name: str | None = None,
                 exc: type[jinja2.exceptions.TemplateRuntimeError] = UndefinedError) -> None:
        if hint is None and obj is jinja2.utils.missing and exc is UndefinedError:
            exc = functools.partial(_MissingVariable, name)  # type: ignore[assignment]
        super().__init__(hint, obj, name, exc)


class _MissingVariable(UndefinedError):
    def __init__(self, name: str | None, message: str | None = None):
        super().__init__(message or f"{name!r} is undefined")
        self.name = name


class _ValueKind(TypeError):
    def __init__(self, name: str | None, kind: str):
        super().__init__(kind)
        self.name, self.kind = name, kind


def _json_default(value: Any) -> Any:
    if isinstance(value, (datetime.date, datetime.time)):  # datetime too
        return value.isoformat()
    if isinstance(value, decimal.Decimal):
        return str(value)
    if isinstance(value, datetime.timedelta):
        return value.total_seconds()
    raise TypeError(f"a {type(value).__name__} value cannot be written as JSON")


def _tojson(value: Any, indent: int | None = None) -> str:
    if isinstance(value, jinja2.Undefined):
        value._fail_with_undefined_error()
    return json.dumps(value, ensure_ascii=False, indent=indent, default=_json_default)


_KINDS_OF: dict[type, str] = {list: "a list", tuple: "a list", dict: "a dict", bytes: "bytes",
                              bytearray: "bytes"}


@jinja2.pass_context
def _finalize(context: jinja2.runtime.Context, value: Any) -> Any:
    """Refuse printing a list / dict / bytes as Python's repr: it is never what a prompt wants."""
    kind = _KINDS_OF.get(type(value))
    if kind is None and isinstance(value, (list, tuple, dict, bytes, bytearray)):  # a subclass
        kind = next(k for t, k in _KINDS_OF.items() if isinstance(value, t))
    if kind is not None:
        name = next((k for k, v in context.parent.items() if v is value), None)
        raise _ValueKind(name, kind)
    return value


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(undefined=_Undefined, autoescape=False, finalize=_finalize,
                                        keep_trailing_newline=False)
    env.filters["tojson"] = _tojson
    return env


_ENV = _environment()


@dataclass(frozen=True)
class RequestTemplate:
    """A loaded template: :meth:`render` turns a row (column -> value) into a request body."""

    kind: str  # "prompt" | "body"
    name: str  # the file name, for messages
    prompt_as: str  # "auto" | "messages" | "prompt" | "input" (prompt kind only)
    columns: frozenset[str]  # the variables the template reads: the columns to scan
    text: str = field(repr=False)
    _template: jinja2.Template = field(repr=False, compare=False)
    # (is a variable, text or name), for templates of text and bare names only: see _plain_parts
    _plain: tuple[tuple[bool, str], ...] | None = field(default=None, repr=False, compare=False)

    @classmethod
    def from_file(cls, path: str | Path, kind: str = "prompt", *, prompt_as: str = "auto") -> RequestTemplate:
        """Load a template file (UTF-8); :class:`TemplateError` when unreadable or not valid jinja2."""
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise TemplateError(f"{path}: no such template file") from None
        except (OSError, UnicodeDecodeError) as e:
            raise TemplateError(f"{path}: cannot be read: {e}") from None
        return cls.from_text(text, kind, name=path.name, prompt_as=prompt_as)

    @classmethod
    def from_text(cls, text: str, kind: str = "prompt", *, name: str = "<template>",
                  prompt_as: str = "auto") -> RequestTemplate:
        """Compile ``text``; :class:`TemplateError` naming the line on a syntax error."""
        if kind not in KINDS:
            raise ValueError(f"template kind must be one of {', '.join(KINDS)}, got {kind!r}")
        _check_prompt_as(prompt_as)
        try:
            tree = _ENV.parse(text, name=name, filename=name)
            # compiled under `name`: a render failure's traceback then tells the template line
            code = _ENV.compile(tree, name=name, filename=name)
        except TemplateSyntaxError as e:
            raise TemplateError(f"{name} line {e.lineno}: {e.message}") from None
        template = _ENV.template_class.from_code(_ENV, code, _ENV.make_globals(None))
        # names the template reads but never sets, less jinja's globals (range, dict, namespace, ...)
        columns = frozenset(jinja2.meta.find_undeclared_variables(tree)) - frozenset(_ENV.globals)
        return cls(kind, name, prompt_as, columns, text, template, _plain_parts(tree))

    def with_prompt_as(self, prompt_as: str) -> RequestTemplate:
        """The same template rendering its prompt as ``prompt_as`` (how "auto" is resolved)."""
        _check_prompt_as(prompt_as)
        return replace(self, prompt_as=prompt_as)

    def render(self, row: Mapping[str, Any], *, columns: Collection[str] | None = None) -> dict[str, Any]:
        """The request body for ``row`` (None values = nulls); :class:`RowError` on failure.
        ``columns``: every column of the input, for the message when a variable is none of them
        (default: the row's keys)."""
        return json.loads(self.render_json(row, columns=columns))

    def renderer(self, columns: Sequence[str], *, all_columns: Collection[str] | None = None,
                 ) -> Callable[[Sequence[Any]], str]:
        """:meth:`render_json` for rows given as values in the order of ``columns`` (what a scan has
        at hand), with no dict built per row where it can: a plain prompt template (text and bare
        ``{{ name }}``) becomes one ``str.format`` call. ``all_columns``: as render's ``columns``."""
        self._check_resolved()
        names = list(columns)

        def slow(values: Sequence[Any]) -> str:
            return self.render_json(dict(zip(names, values, strict=True)), columns=all_columns)

        plain = self._plain
        if plain is None or self.kind != "prompt" or any(name and part not in names for name, part in plain):
            return slow
        index = {name: i for i, name in enumerate(names)}
        fmt = "".join(f"{{{index[part]}}}" if is_name else part.replace("{", "{{").replace("}", "}}")
                      for is_name, part in plain)
        head, tail = _WRAPS[self.prompt_as]

        def render(values: Sequence[Any]) -> str:
            for value in values:
                if type(value) is not str and (value is None or isinstance(value, _REFUSED)):
                    return slow(values)  # jinja's path: the same text, or the same error
            return head + _encode_string(fmt.format(*values)) + tail  # format(v, "") == str(v)

        return render

    def _check_resolved(self) -> None:
        if self.kind == "prompt" and self.prompt_as == "auto":
            raise ValueError(f"{self.name}: prompt_as 'auto' must be resolved (with_prompt_as) before "
                             "rendering")

    def render_json(self, row: Mapping[str, Any], *, columns: Collection[str] | None = None) -> str:
        """:meth:`render`'s body as compact JSON text (what the client sends: no second encoding)."""
        self._check_resolved()
        text = self._plain_text(row) if self._plain is not None else None
        if text is None:
            text = self._render_text(row, columns)
        if self.kind == "body":
            try:
                body = json.loads(text)
            except ValueError as e:
                raise RowError(f"{self.name}: the rendered body is not JSON: {e}") from None
            if not isinstance(body, dict):
                raise RowError(f"{self.name}: the rendered body is a JSON {type(body).__name__}, "
                               "not an object")
            return json.dumps(body, ensure_ascii=False, separators=(",", ":"))
        head, tail = _WRAPS[self.prompt_as]
        return head + _encode_string(text) + tail

    def _plain_text(self, row: Mapping[str, Any]) -> str | None:
        """A template of text and bare ``{{ name }}`` only, rendered without jinja (several times
        faster); None when a value needs jinja's own path (a null, a missing column, a list...),
        which then renders it or raises the very same error."""
        out = []
        for is_name, part in self._plain:  # type: ignore[union-attr]
            if not is_name:
                out.append(part)
                continue
            value = row.get(part)
            if type(value) is str:
                out.append(value)
            elif value is None or isinstance(value, _REFUSED):
                return None
            else:
                out.append(str(value))  # as jinja prints it
        return "".join(out)

    def _render_text(self, row: Mapping[str, Any], columns: Collection[str] | None) -> str:
        context = {k: v for k, v in row.items() if v is not None}
        try:
            return self._template.render(context)
        except _MissingVariable as e:
            if e.name in row:
                raise RowError(self._at(e, f"column {e.name!r} is null (use `{e.name} | default(...)` "
                                           "or `is defined` where a null is expected)")) from None
            names = sorted(columns if columns is not None else row)
            raise RowError(self._at(e, f"no column {e.name!r} (columns: {', '.join(names) or 'none'})")) \
                from None
        except _ValueKind as e:
            what = f"column {e.name!r}" if e.name else "a value"
            raise RowError(self._at(e, f"{what} is {e.kind}: write it with |tojson or |join")) from None
        except SecurityError as e:
            raise RowError(self._at(e, f"refused by the sandbox: {e}")) from None
        except Exception as e:  # noqa: BLE001 - any failure of a user's template is this row's error
            raise RowError(self._at(e, f"{type(e).__name__}: {e}")) from None

    def _at(self, e: BaseException, message: str) -> str:
        """``message`` prefixed with the template line that failed, when the traceback tells it."""
        line = None
        for frame in traceback.extract_tb(e.__traceback__):
            if frame.filename == self.name:
                line = frame.lineno
        return f"{self.name} line {line}: {message}" if line else f"{self.name}: {message}"


_REFUSED = (list, tuple, dict, bytes, bytearray)
# A prompt's body around its JSON string, by prompt_as.
_WRAPS = {"messages": ('{"messages":[{"role":"user","content":', "}]}"), "prompt": ('{"prompt":', "}"),
          "input": ('{"input":', "}")}
_encode_string = json.encoder.encode_basestring  # json.dumps(text, ensure_ascii=False), minus its set-up


def _plain_parts(tree: jinja2.nodes.Template) -> tuple[tuple[bool, str], ...] | None:
    """The template as text and variable names, if it is nothing more (no filter, tag, attribute,
    expression or global): most prompt templates are, and they need no jinja at render time."""
    parts: list[tuple[bool, str]] = []
    for node in tree.body:
        if not isinstance(node, jinja2.nodes.Output):
            return None
        for child in node.nodes:
            if isinstance(child, jinja2.nodes.TemplateData):
                parts.append((False, child.data))
            elif (isinstance(child, jinja2.nodes.Name) and child.ctx == "load"
                  and child.name not in _ENV.globals):
                parts.append((True, child.name))
            else:
                return None
    return tuple(parts)


def _check_prompt_as(prompt_as: str) -> None:
    if prompt_as not in PROMPT_AS:
        raise ValueError(f"prompt_as must be one of {', '.join(PROMPT_AS)}, got {prompt_as!r}")
