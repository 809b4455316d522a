"""``Tokenizer``: a model's tokenizer files and chat template, without transformers.

Wraps a ``tokenizers.Tokenizer`` (tokenizer.json) with what tokenizer_config.json and
generation_config.json add: special tokens, whether to prepend BOS, the EOS ids, and the chat
template. Chat templates come with the model, so they are rendered in jinja2's
``ImmutableSandboxedEnvironment`` with the helpers transformers provides (``raise_exception``,
``strftime_now``, ``tojson``); a template that reaches for Python internals fails with a
``ChatTemplateError`` instead of running.

The scheduler gets the files' bytes from Redis, hence ``from_files`` next to ``from_dir``.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
import tokenizers
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

from batchinfer.workers.text.token_bytes import TokenDecoder

_Text = bytes | str


# encode_within: a text longer than this many characters per allowed token has its prefix of that
# length tokenised first (prose runs at about 4 characters a token, code and CJK at 1-3).
PREFIX_CHARS_PER_TOKEN = 8


class ChatTemplateError(ValueError):
    """The chat template failed to render (bad template, unsafe access, or ``raise_exception``)."""


class PromptTooLong(ValueError):
    """A text that has more tokens than a limit, found without tokenising it whole; ``str()`` says
    how many at least (``"more than N tokens"``)."""


class Tokenizer:
    """Encode / decode / chat-template for one model; see ``from_dir`` and ``from_files``."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        config: dict[str, Any] | None = None,
        generation_config: dict[str, Any] | None = None,
        chat_template: str | None = None,
    ):
        # tokenizer.json may carry padding / truncation settings (BERT exports: pad to 128): like
        # transformers' tokenizers, ours pads and truncates only when asked, never from the file.
        backend.no_padding()
        backend.no_truncation()
        self.backend = backend
        self.config = config or {}
        self.generation_config = generation_config or {}
        self.chat_template = chat_template if chat_template is not None else _pick_template(self.config)

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Read tokenizer.json (required), tokenizer_config.json, generation_config.json and
        chat_template.jinja (which newer transformers write instead of the config's field).

        A ``.gguf`` file, or a folder holding one and no tokenizer.json, goes to ``from_gguf``."""
        path = Path(path)
        tok_file = path / "tokenizer.json"
        if not tok_file.is_file() and looks_like_gguf(path):
            return cls.from_gguf(path)
        if not tok_file.is_file():
            raise FileNotFoundError(f"{tok_file}: tokenizer.json not found "
                                    "(only fast tokenizers are supported)")

        def read(name: str) -> bytes | None:
            f = path / name
            return f.read_bytes() if f.is_file() else None

        template = read("chat_template.jinja")
        return cls.from_files(tok_file.read_bytes(), read("tokenizer_config.json"),
                              read("generation_config.json"),
                              template.decode("utf-8") if template is not None else None)

    @classmethod
    def from_gguf(cls, path: str | Path) -> Tokenizer:
        """The tokenizer a GGUF file's metadata describes (a ``.gguf`` file or a folder holding one):
        see ``batchinfer.workers.models.gguf.tokenizer``."""
        # Imported here: the scheduler loads this module but never reads a GGUF (Redis has the files)
        from batchinfer.workers.models.gguf.tokenizer import tokenizer_files

        files = tokenizer_files(path)
        return cls.from_files(files["tokenizer.json"], files.get("tokenizer_config.json"),
                              files.get("generation_config.json"))

    @classmethod
    def from_files(
        cls,
        tokenizer_json: _Text,
        tokenizer_config_json: _Text | None = None,
        generation_config_json: _Text | None = None,
        chat_template: str | None = None,
    ) -> Tokenizer:
        """Build from the files' contents (bytes or str); ``chat_template`` overrides the config's."""
        text = tokenizer_json.decode("utf-8") if isinstance(tokenizer_json, bytes) else tokenizer_json
        try:
            backend = tokenizers.Tokenizer.from_str(text)
        except Exception as e:  # tokenizers raises a bare Exception on bad JSON
            raise ValueError(f"tokenizer.json: cannot be parsed: {e}") from None
        return cls(backend, _parse_json(tokenizer_config_json, "tokenizer_config.json"),
                   _parse_json(generation_config_json, "generation_config.json"), chat_template)

    # --- special tokens --------------------------------------------------------------------
    def _special_id(self, name: str) -> int | None:
        token = self.config.get(name)
        if isinstance(token, dict):  # serialised AddedToken
            token = token.get("content")
        return self.backend.token_to_id(token) if isinstance(token, str) else None

    @cached_property
    def bos_token_id(self) -> int | None:
        bos = self._special_id("bos_token")
        return bos if bos is not None else self.generation_config.get("bos_token_id")

    @cached_property
    def pad_token_id(self) -> int | None:
        pad = self._special_id("pad_token")
        return pad if pad is not None else self.generation_config.get("pad_token_id")

    @cached_property
    def eos_token_ids(self) -> list[int]:
        """generation_config's eos_token_id (one or a list) then tokenizer_config's eos_token."""
        out: list[int] = []
        gen = self.generation_config.get("eos_token_id")
        for value in [*(gen if isinstance(gen, list) else [gen]), self._special_id("eos_token")]:
            if value is not None and int(value) not in out:
                out.append(int(value))
        return out

    @cached_property
    def all_special_ids(self) -> list[int]:
        """Ids of the added tokens marked special, plus bos / eos / pad."""
        ids = {i for i, tok in self.backend.get_added_tokens_decoder().items() if tok.special}
        ids.update(self.eos_token_ids)
        ids.update(i for i in (self.bos_token_id, self.pad_token_id) if i is not None)
        return sorted(ids)

    @property
    def vocab_size(self) -> int:
        """Number of token ids the tokenizer knows, added tokens included."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    # --- encode / decode -------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; with ``add_special_tokens`` the post-processor's tokens and, when
        tokenizer_config sets ``add_bos_token`` / ``add_eos_token``, BOS / EOS (once)."""
        if not isinstance(text, str):
            raise TypeError(f"encode() expects a str, got {type(text).__name__}")
        return self._finish(self.backend.encode(text, add_special_tokens=add_special_tokens).ids,
                            add_special_tokens)

    def encode_within(self, text: str, limit: int | None, add_special_tokens: bool = True) -> list[int]:
        """``encode(text)``, but a text with certainly more than ``limit`` tokens raises
        :class:`PromptTooLong` without being tokenised whole: first by its length (no token of a BPE
        vocabulary covers more than ``max_token_chars`` characters of text), then by the
        tokens of a prefix (a cut changes at most the last words' tokens, hence the slack)."""
        if limit is None or self.max_token_chars is None:
            return self.encode(text, add_special_tokens)
        if len(text) > limit * self.max_token_chars:
            raise PromptTooLong(f"at least {-(-len(text) // self.max_token_chars)} tokens "
                                f"({len(text)} characters)")
        head = PREFIX_CHARS_PER_TOKEN * (limit + 1)
        if len(text) > head:
            n = len(self.backend.encode(text[:head], add_special_tokens=False).ids)
            slack = 16 + limit // 100
            if n > limit + slack:
                raise PromptTooLong(f"more than {n - slack} tokens (its first {head} characters have {n})")
        return self.encode(text, add_special_tokens)

    @cached_property
    def max_token_chars(self) -> int | None:
        """The most characters of text one token can cover, for the vocabularies where the length of a
        token's string bounds it (BPE without fused unknowns); None where one unknown token may stand
        for a run of any length (WordPiece, WordLevel, Unigram, BPE with ``fuse_unk``)."""
        model = self.backend.model
        if not isinstance(model, tokenizers.models.BPE) or (model.fuse_unk and not model.byte_fallback):
            return None
        return max(map(len, self.backend.get_vocab(with_added_tokens=True)), default=1) or 1

    def encode_batch(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        """``encode`` of many texts (in parallel inside the tokenizers library)."""
        encodings = self.backend.encode_batch(list(texts), add_special_tokens=add_special_tokens)
        return [self._finish(e.ids, add_special_tokens) for e in encodings]

    def _finish(self, ids: list[int], add_special_tokens: bool) -> list[int]:
        if not add_special_tokens:
            return ids
        bos, eos = self.bos_token_id, self._special_id("eos_token")
        if self.config.get("add_bos_token") and bos is not None and ids[:1] != [bos]:
            ids = [bos, *ids]
        if self.config.get("add_eos_token") and eos is not None and ids[-1:] != [eos]:
            ids = [*ids, eos]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids`` (ids outside the vocabulary are skipped)."""
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    @cached_property
    def _token_decoder(self) -> TokenDecoder:
        return TokenDecoder(self.backend)

    def decode_token(self, token_id: int) -> tuple[str, bytes]:
        """One token decoded alone (special tokens kept, as vLLM's ``decoded_token``) and its bytes:
        the text's UTF-8, or the token's raw bytes where it holds part of a character (cached)."""
        return self._token_decoder.decode(token_id)

    # --- chat ------------------------------------------------------------------------------
    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        chat_template: str | None = None,
        **kwargs: Any,
    ) -> str | list[int]:
        """Render ``messages`` with the model's chat template, or ``chat_template`` when given (extra
        ``kwargs`` reach the template, e.g. ``tools`` or ``enable_thinking``). ``tokenize=True``
        returns ids, encoded without adding special tokens again (the template writes them)."""
        template = chat_template if chat_template is not None else self.chat_template
        if not template:
            raise ValueError("this tokenizer has no chat template (tokenizer_config.json chat_template "
                             "or chat_template.jinja)")
        messages = validate_messages(messages)
        special = {name: _token_text(self.config.get(name))
                   for name in ("bos_token", "eos_token", "pad_token", "unk_token")}
        try:
            text = _compile(template).render(
                messages=messages, add_generation_prompt=add_generation_prompt, **special, **kwargs)
        except jinja2.exceptions.SecurityError as e:
            raise ChatTemplateError(f"chat template tried an unsafe operation and was stopped: {e}") from None
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template: {e}") from None
        return self.encode(text, add_special_tokens=False) if tokenize else text


def truncate_text_ids(tokenizer: Tokenizer, text: str, ids: list[int], keep: int) -> list[int]:
    """The last ``keep`` tokens of ``text``'s encoding ``ids``, keeping the special tokens the
    tokenizer adds around it (``[CLS] ... [SEP]``, a BOS), as a left-truncating tokenizer does for
    vLLM's ``truncate_prompt_tokens``; without such tokens, simply ``ids[-keep:]``."""
    content = tokenizer.encode(text, add_special_tokens=False)
    extra = len(ids) - len(content)
    start = next((p for p in range(extra + 1) if ids[p:p + len(content)] == content), None) \
        if 0 < extra < keep else None
    if start is None:  # no specials around the text (or no room beside them): plain last tokens
        return ids[-keep:]
    return ids[:start] + content[len(content) - (keep - extra):] + ids[start + len(content):]


def looks_like_gguf(path: str | Path) -> bool:
    """Whether ``path`` is a ``.gguf`` file or a folder holding ``.gguf`` files (checked by name only)."""
    path = Path(path)
    if path.suffix.lower() == ".gguf":
        return True
    return path.is_dir() and any(p.suffix.lower() == ".gguf" for p in path.iterdir())


def validate_messages(messages: Any) -> list[dict[str, Any]]:
    """Check a chat (list of {role, content}); text parts ``[{"type": "text", "text": ...}]`` are
    joined into one string. Raises ``ValueError`` naming the offending field."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages: expected a non-empty list of {role, content} objects")
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise ValueError(f"{where}: expected an object with role and content, "
                             f"got {type(message).__name__}")
        role, content = message.get("role"), message.get("content")
        if not isinstance(role, str) or not role:
            raise ValueError(f"{where}.role: expected a non-empty string, got {role!r}")
        if isinstance(content, list):
            content = "".join(_text_part(part, f"{where}.content[{j}]") for j, part in enumerate(content))
        elif content is None:
            if not message.get("tool_calls"):
                raise ValueError(f"{where}.content: missing (only a message with tool_calls may omit it)")
        elif not isinstance(content, str):
            raise ValueError(f"{where}.content: expected a string or a list of text parts, "
                             f"got {type(content).__name__}")
        out.append({**message, "content": content})
    return out


def _text_part(part: Any, where: str) -> str:
    if not isinstance(part, dict) or part.get("type") != "text":
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        raise ValueError(f"{where}: only text parts are supported, got {kind!r}")
    if not isinstance(part.get("text"), str):
        raise ValueError(f"{where}.text: expected a string")
    return part["text"]


def _token_text(token: Any) -> str | None:
    return token.get("content") if isinstance(token, dict) else token


def _parse_json(data: _Text | None, name: str) -> dict[str, Any] | None:
    if data is None:
        return None
    try:
        value = json.loads(data)
    except json.JSONDecodeError as e:
        raise ValueError(f"{name}: invalid JSON at line {e.lineno}: {e.msg}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name}: expected a JSON object")
    return value


def _pick_template(config: dict[str, Any]) -> str | None:
    """tokenizer_config's chat_template: a string, or a list of named templates (use "default")."""
    template = config.get("chat_template")
    if isinstance(template, list):
        named: dict[str | None, Any] = {
            t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        if "default" not in named:
            # key=str: a template without a name (None) must not break the sort of the others
            raise ValueError(f"tokenizer_config.json: chat_template has no 'default' among "
                             f"{sorted(named, key=str)}")
        return named["default"]
    return template


class _GenerationTag(Extension):
    """``{% generation %}...{% endgeneration %}`` (marks assistant text in HF templates): renders its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


def _raise_exception(message: str):
    raise jinja2.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


class _ChatSandbox(ImmutableSandboxedEnvironment):
    """The sandbox, plus a cap on ``*`` and ``**``: jinja2 bounds ``range`` but not
    ``'a' * 10**11``, which would exhaust memory from a hostile template."""

    intercepted_binops = frozenset({"*", "**"})
    MAX_REPEAT = 1_000_000  # items or characters one ``*`` may build
    MAX_POWER_BITS = 4096  # bits one ``**`` may produce

    def call_binop(self, context, operator, left, right):
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                size = len(seq) * n if isinstance(seq, str | list | tuple) and isinstance(n, int) else 0
                if size > self.MAX_REPEAT:
                    raise SecurityError(f"chat template: '*' would build {size} items "
                                        f"(limit {self.MAX_REPEAT})")
        elif operator == "**" and isinstance(left, int) and isinstance(right, int) and right > 0:
            bits = max(1, abs(left).bit_length()) * right
            if bits > self.MAX_POWER_BITS:
                raise SecurityError(f"chat template: '**' would make a {bits}-bit number "
                                    f"(limit {self.MAX_POWER_BITS})")
        return super().call_binop(context, operator, left, right)


_ENV = _ChatSandbox(trim_blocks=True, lstrip_blocks=True,
                    extensions=[_GenerationTag, "jinja2.ext.loopcontrols"])
_ENV.filters["tojson"] = _tojson
_ENV.globals["raise_exception"] = _raise_exception
_ENV.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
_TEMPLATES: dict[str, jinja2.Template] = {}


def _compile(source: str) -> jinja2.Template:
    if source not in _TEMPLATES:
        try:
            _TEMPLATES[source] = _ENV.from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise ChatTemplateError(f"chat template: syntax error at line {e.lineno}: {e.message}") from None
    return _TEMPLATES[source]
