"""One logging setup for every batchinfer process: human or JSON lines, request ids, no secrets.

``setup_logging("json")`` makes each line one JSON object with ``ts``, ``level``, ``logger``, ``msg``
and, when known, ``job_id`` / ``request_id`` / ``worker`` / ``model`` / ``batch_id``. Those come from
``extra={"job_id": ...}`` on the call or from :func:`log_context` around it. Every line, exception
tracebacks included, passes through :func:`redact`, so Redis URLs with passwords, ``password=...``
and tokens never reach a log shipper.
"""

from __future__ import annotations

import contextlib
import contextvars
import datetime as dt
import json
import logging
import re
import sys
from collections.abc import Iterator
from typing import IO, Any

FORMATS = ("human", "json")
CONTEXT_FIELDS = ("job_id", "request_id", "worker", "model", "batch_id")

_context: contextvars.ContextVar[dict[str, str] | None] = contextvars.ContextVar(
    "batchinfer_log_context", default=None
)

# --- redaction -------------------------------------------------------------------------------------
# scheme://user:password@host -> scheme://user:***@host (redis, rediss, http, amqp, ...).
_URL_USERINFO = re.compile(r"(?P<pre>\b[a-zA-Z][a-zA-Z0-9+.-]*://[^:/@\s\"']*):(?P<secret>[^@/\s\"']+)@")
# key=value / key: value / "key": "value" for keys that name a secret. A prefix such as
# ``redis_password`` or ``BATCHINFER_API_KEY`` is allowed; ``prompt_tokens`` is not a secret.
_SECRET_KEYS = (
    r"(?:[A-Za-z0-9]+[_-])*(?:password|passwd|pwd|secret|api[_-]?key|access[_-]?key|private[_-]?key)"
    r"|(?:access|auth|refresh|id|bearer|session)?[_-]?token"
)
_KEY_VALUE = re.compile(
    rf"(?P<pre>(?<![A-Za-z0-9_])(?:{_SECRET_KEYS})[\"']?\s*[=:]\s*[\"']?)(?P<secret>[^\s\"'&,;}}\]\\]+)",
    re.IGNORECASE,
)
_BEARER = re.compile(r"(?P<pre>\b(?:Bearer|Basic)\s+)(?P<secret>[A-Za-z0-9._~+/=-]{8,})")
REDACTED = "***"


def redact(text: str) -> str:
    """``text`` with passwords, tokens and URL credentials replaced by ``***``."""
    if not text:
        return text
    for pattern in (_URL_USERINFO, _KEY_VALUE, _BEARER):
        text = pattern.sub(_mask_secret_group, text)
    return text


def _mask_secret_group(match: re.Match[str]) -> str:
    whole, start = match.group(0), match.start()
    return whole[: match.start("secret") - start] + REDACTED + whole[match.end("secret") - start:]


class RedactingFilter(logging.Filter):
    """Handler filter: renders the message once, redacted, so no formatter sees the raw arguments."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception as exc:  # a bad %-format must not lose the line
            message = f"{record.msg!r} (unformattable arguments: {exc})"
        record.msg = redact(message)
        record.args = None
        return True


class ContextFilter(logging.Filter):
    """Copies the fields bound by :func:`log_context` onto records that do not set them already."""

    def filter(self, record: logging.LogRecord) -> bool:
        bound = _context.get()
        if bound:
            for key, value in bound.items():
                if getattr(record, key, None) is None:
                    setattr(record, key, value)
        return True


@contextlib.contextmanager
def log_context(**fields: Any) -> Iterator[None]:
    """Bind ``job_id`` / ``request_id`` / ``worker`` / ``model`` / ``batch_id`` to every line logged inside.

    >>> with log_context(job_id="j1", request_id="j1:7"):
    ...     log.warning("prompt too long")  # carries job_id and request_id
    """
    unknown = set(fields) - set(CONTEXT_FIELDS)
    if unknown:
        raise ValueError(f"log_context: unknown field(s) {sorted(unknown)}; allowed: {CONTEXT_FIELDS}")
    merged = dict(_context.get() or {})
    merged.update({k: str(v) for k, v in fields.items() if v is not None})
    token = _context.set(merged)
    try:
        yield
    finally:
        _context.reset(token)


def request_extra(job_id: str | None = None, request_id: str | None = None, **more: Any) -> dict[str, Any]:
    """``extra=`` for one log call about a request: ``log.error("...", extra=request_extra(j, r))``."""
    fields = {"job_id": job_id, "request_id": request_id, **more}
    return {k: v for k, v in fields.items() if v is not None}


# --- formatters ------------------------------------------------------------------------------------
class HumanFormatter(logging.Formatter):
    """``2025-01-02 10:00:00,123 WARNING batchinfer.scheduler: message [job_id=j1 request_id=j1:7]``."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        # The whole line, traceback included: another handler may have cached an unredacted exc_text.
        line = redact(super().format(record))
        tags = " ".join(f"{k}={getattr(record, k)}" for k in CONTEXT_FIELDS
                        if getattr(record, k, None) is not None)
        if not tags:
            return line
        first, nl, rest = line.partition("\n")  # tags stay on the message line, before a traceback
        return f"{first} [{tags}]{nl}{rest}"


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts (UTC, ISO 8601, ms), level, logger, msg, context fields, exc."""

    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        ts = dt.datetime.fromtimestamp(record.created, dt.timezone.utc)
        entry: dict[str, Any] = {
            "ts": ts.isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "msg": message,
        }
        for key in CONTEXT_FIELDS:
            value = getattr(record, key, None)
            if value is not None:
                entry[key] = value if isinstance(value, (int, float, bool)) else str(value)
        if record.exc_info:
            entry["exc"] = redact(self.formatException(record.exc_info))
        if record.stack_info:
            entry["stack"] = redact(self.formatStack(record.stack_info))
        return json.dumps(entry, ensure_ascii=False, default=str)


def _level(level: str | int) -> int:
    if isinstance(level, int):
        return level
    value = logging.getLevelName(str(level).upper())
    if not isinstance(value, int):
        raise ValueError(f"log level: unknown level {level!r}; use DEBUG, INFO, WARNING, ERROR or CRITICAL")
    return value


def setup_logging(fmt: str = "human", level: str | int = "INFO",
                  stream: IO[str] | None = None) -> logging.Handler:
    """Configure the root logger once for this process (calling again replaces the previous setup).

    ``fmt`` is ``"human"`` (default) or ``"json"``; lines go to ``stream`` (default stderr, so a
    command's stdout stays machine-readable). Returns the installed handler.
    """
    if fmt not in FORMATS:
        raise ValueError(f"log format: {fmt!r} is not one of {', '.join(FORMATS)}")
    numeric = _level(level)
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else HumanFormatter())
    handler.addFilter(ContextFilter())
    handler.addFilter(RedactingFilter())
    handler._batchinfer = True  # type: ignore[attr-defined]  # marks ours, to replace on a second call
    root = logging.getLogger()
    for old in [h for h in root.handlers if getattr(h, "_batchinfer", False)]:
        root.removeHandler(old)
        old.close()
    root.addHandler(handler)
    root.setLevel(numeric)
    logging.captureWarnings(True)
    return handler


__all__ = [
    "CONTEXT_FIELDS", "FORMATS", "ContextFilter", "HumanFormatter", "JsonFormatter", "RedactingFilter",
    "log_context", "redact", "request_extra", "setup_logging",
]
