"""The wire protocol, version 1 (docs/protocol.md): intake entries, the URL and field-name constants,
job ids and :class:`RequestError`. Batch requests and result rows are in
:mod:`batchinfer.protocol.rows`.

Request bodies are validated in :mod:`batchinfer.protocol.bodies`. Nothing here touches Redis.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["PROTOCOL_VERSION", "IntakeEntry", "RequestError", "valid_job_id"]

PROTOCOL_VERSION = "1"

CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"
OPENAI_LINE_FIELDS = ("custom_id", "method", "url", "body")
# Body fields that are not sampling parameters.
REQUEST_FIELDS = ("custom_id", "model", "prompt", "prompt_token_ids", "messages", "priority", "metadata")
# OpenAI fields accepted and ignored: they change nothing about the generated tokens.
IGNORED_OPENAI_FIELDS = ("user", "store")
MESSAGE_ROLES = ("system", "developer", "user", "assistant", "tool")
MESSAGE_FIELDS = ("role", "content", "name", "tool_calls", "tool_call_id")
MAX_CUSTOM_ID_CHARS = 512


class RequestError(ValueError):
    """A request or entry that cannot be served.

    ``code`` is machine-readable (``invalid_json``, ``invalid_request``, ``unsupported_url``,
    ``prompt_too_long``, ``unknown_model``, ``protocol_error``, ...), ``field`` the offending field
    (dotted path, e.g. ``messages[1].role``) and ``line`` the 1-based input line, when known.
    ``context`` holds whatever could still be read, so that the error row can still reach its job
    and caller: ``job``, ``idx``, ``line``, ``reply_to`` of a malformed intake entry, and the
    ``custom_id`` of a JSON body that failed validation.
    """

    def __init__(self, code: str, message: str, *, field: str | None = None, line: int | None = None,
                 context: dict[str, Any] | None = None):
        self.code = code
        self.message = message
        self.field = field
        self.line = line
        self.context = context or {}
        super().__init__(str(self))

    def __str__(self) -> str:
        where = f"line {self.line}: " if self.line is not None else ""
        return f"{where}{self.message}"

    def at_line(self, line: int | None) -> RequestError:
        """This error with its input line set (when not already known)."""
        if self.line is None and line is not None:
            self.line = line
        return self


# -- intake entries --------------------------------------------------------------------------------


@dataclass
class IntakeEntry:
    """One entry of the intake stream ``{bi}:requests``: a raw body plus routing fields."""

    body: str
    job_id: str | None = None
    idx: int | None = None
    line: int | None = None
    reply_to: str | None = None
    client_request_id: str | None = None

    def to_fields(self) -> dict[str, str]:
        """The XADD field map (absent optional fields are left out)."""
        out = {"v": PROTOCOL_VERSION, "body": self.body}
        for name, value in (("job", self.job_id), ("idx", self.idx), ("line", self.line),
                            ("reply_to", self.reply_to), ("client_request_id", self.client_request_id)):
            if value is not None:
                out[name] = str(value)
        return out

    @classmethod
    def from_fields(cls, raw: Mapping[bytes, bytes] | Mapping[str, str]) -> IntakeEntry:
        """Parse an XREADGROUP entry; a foreign or malformed entry is a ``protocol_error``."""
        fields_: dict[str, str] = {}
        not_utf8: list[str] = []  # each field decoded alone, so a bad body still leaves job / idx readable
        for k, v in raw.items():
            try:
                name = k.decode() if isinstance(k, bytes) else str(k)
            except UnicodeDecodeError:
                not_utf8.append(repr(k))
                continue
            try:
                fields_[name] = v.decode() if isinstance(v, bytes) else str(v)
            except UnicodeDecodeError as e:
                not_utf8.append(f"{name} ({e.reason} at byte {e.start})")
        context: dict[str, Any] = {k: fields_[k] for k in ("job", "idx", "line", "reply_to") if k in fields_}
        for k in ("idx", "line"):  # best effort, for the error row
            if k in context:
                context[k] = _int_or_none(context[k])
        line: int | None = context.get("line")

        def fail(message: str, fld: str | None = None) -> RequestError:
            return RequestError("protocol_error", message, field=fld, line=line, context=context)

        if not_utf8:
            raise fail(f"intake entry field(s) not UTF-8: {', '.join(not_utf8)}", not_utf8[0].split(" ")[0])
        if "v" not in fields_:
            raise fail("intake entry has no protocol version field 'v' (not a batchinfer entry?)", "v")
        if fields_["v"] != PROTOCOL_VERSION:
            raise fail(f"unsupported protocol version v={fields_['v']!r} (this build speaks "
                       f"v={PROTOCOL_VERSION})", "v")
        unknown = sorted(set(fields_) - {"v", "body", "job", "idx", "line", "reply_to", "client_request_id"})
        if unknown:
            raise fail(f"unknown intake field(s): {', '.join(unknown)}", unknown[0])
        if "body" not in fields_:
            raise fail("intake entry has no 'body' field", "body")
        job = fields_.get("job") or None
        if job is not None and not valid_job_id(job):
            raise fail(f"job id {job!r} is invalid (letters, digits, '.', '_', '-'; at most 128)", "job")
        idx = line_no = None
        if "idx" in fields_:
            idx = _int_or_none(fields_["idx"])
            if idx is None or idx < 0:
                raise fail(f"idx must be a non-negative integer, got {fields_['idx']!r}", "idx")
        if job is not None and idx is None:
            raise fail("an entry with a job id needs 'idx' (its index in the job)", "idx")
        if "line" in fields_:
            line_no = _int_or_none(fields_["line"])
            if line_no is None or line_no < 1:
                raise fail(f"line must be a positive integer, got {fields_['line']!r}", "line")
        return cls(body=fields_["body"], job_id=job, idx=idx, line=line_no,
                   reply_to=fields_.get("reply_to") or None,
                   client_request_id=fields_.get("client_request_id") or None)


def valid_job_id(job_id: str) -> bool:
    """Job ids appear in key names and file names: ``[A-Za-z0-9][A-Za-z0-9._-]{0,127}``."""
    return (0 < len(job_id) <= 128 and job_id[0].isascii() and job_id[0].isalnum()
            and all(c.isascii() and (c.isalnum() or c in "._-") for c in job_id))


def _int_or_none(text: str) -> int | None:
    try:
        return int(text)
    except (TypeError, ValueError):
        return None
