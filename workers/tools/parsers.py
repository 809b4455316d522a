"""The ``auto`` tool-call parsers by vLLM's names, and the one a chat template makes unambiguous.

Each parser module has ``parse(text) -> Parsed | None`` (see :mod:`.parsed`).
"""

from __future__ import annotations

from collections.abc import Callable

from batchinfer.workers.tools import hermes, llama3_json, mistral, pythonic
from batchinfer.workers.tools.parsed import Parsed

_PARSE: dict[str, Callable[[str], Parsed | None]] = {
    "hermes": hermes.parse,
    "llama3_json": llama3_json.parse,
    "mistral": mistral.parse,
    "pythonic": pythonic.parse,
}
TOOL_PARSERS: tuple[str, ...] = tuple(_PARSE)
# Parsers whose markers are special tokens ([TOOL_CALLS], [ARGS]): the text they read must be
# decoded with skip_special_tokens=False, as vLLM's mistral parser asks of the request. (Llama's
# <|python_tag|> is optional to llama3_json; hermes' <tool_call> is an ordinary added token.)
NEEDS_SPECIAL_TOKENS: frozenset[str] = frozenset({"mistral"})

# What each format's templates write: the call syntax they teach the model, or its special tokens.
_MARKERS: dict[str, tuple[str, ...]] = {
    "hermes": ("<tool_call>",),
    "mistral": ("[TOOL_CALLS]",),
    # vLLM's pythonic templates (Llama 3.2 / 4, ToolACE) spell out the list-of-calls syntax.
    "pythonic": ("[func_name1(", "func_name1(params_name1="),
    # Llama 3.1 / 3.2 / 4's own templates: the JSON call format, the python tag of their tool turns.
    "llama3_json": ('"parameters": dictionary of argument name', "<|python_tag|>"),
}


def parser_function(name: str) -> Callable[[str], Parsed | None]:
    """The ``parse`` function of parser ``name``; ``ValueError`` listing the names otherwise."""
    try:
        return _PARSE[name]
    except KeyError:
        raise ValueError(f"unknown tool-call parser {name!r}; the parsers are "
                         f"{', '.join(TOOL_PARSERS)}") from None


def parser_for_template(chat_template: str | None) -> str | None:
    """The parser whose format ``chat_template`` teaches, when exactly one matches; else None
    (no template, a template without tools, or one that mentions several formats)."""
    if not chat_template:
        return None
    found = {name for name, markers in _MARKERS.items() if any(m in chat_template for m in markers)}
    if found == {"pythonic", "llama3_json"}:
        found = {"pythonic"}  # a pythonic Llama template keeps the Llama tokens; its syntax decides
    return found.pop() if len(found) == 1 else None
