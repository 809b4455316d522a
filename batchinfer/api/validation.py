"""An OpenAI batch input file checked as OpenAI checks one before it runs (pure: lines in, errors out).

A batch whose file fails any check never runs: it ends ``failed`` with ``errors.data[]``, each error
``{code, message, line, param}`` (``line`` 1-based, None for the file as a whole). The codes:

==============================  ====================================================================
``empty_file``                  the file holds no request (blank lines only, or nothing)
``too_many_tasks``              more requests than the batch limit (``BATCHINFER_API_MAX_BATCH_REQUESTS``)
``line_too_long``               a line over ``BATCHINFER_MAX_LINE_BYTES``
``invalid_json_line``           a line that is not UTF-8 JSON, or JSON that is not an object
``missing_required_parameter``  no ``custom_id``, ``method``, ``url``, ``body`` or ``body.model``
``invalid_value``               one of those of the wrong type (``param`` names it)
``invalid_method``              ``method`` other than ``POST``
``url_mismatch``                ``url`` other than the batch's ``endpoint``
``model_mismatch``              ``body.model`` other than the first request's (a batch runs one model)
``duplicate_custom_id``         a ``custom_id`` an earlier line has (``message`` names that line)
==============================  ====================================================================

Checking is one pass in bounded memory: 16 bytes per request for duplicate detection, at most
``max_errors`` errors kept, and it stops past ``max_requests``. Per-request problems this does not
see (an unknown sampling parameter, a prompt longer than the model's context) are the scheduler's:
they become lines of the batch's error file at run time, as at OpenAI.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from batchinfer.protocol.entries import MAX_CUSTOM_ID_CHARS

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses")
_BOM = b"\xef\xbb\xbf"
_LINE_FIELDS = ("custom_id", "method", "url", "body")


@dataclass(frozen=True)
class LineError:
    """One validation error: OpenAI's ``BatchError`` (``code``, ``message``, ``line``, ``param``)."""

    code: str
    message: str
    line: int | None = None
    param: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"code": self.code, "message": self.message, "line": self.line, "param": self.param}


@dataclass
class BatchCheck:
    """What a check found: the requests counted, the errors (at most ``max_errors``; ``truncated``
    when there were more) and the model every request names (None when none was read)."""

    requests: int = 0
    errors: list[LineError] = field(default_factory=list)
    model: str | None = None
    truncated: bool = False

    @property
    def ok(self) -> bool:
        return not self.errors


class _Stop(Exception):
    """The check cannot usefully go on (too many errors or requests)."""


class _Checker:
    def __init__(self, endpoint: str, max_requests: int, max_line_bytes: int, max_errors: int):
        self.endpoint, self.max_requests = endpoint, max_requests
        self.max_line_bytes, self.max_errors = max_line_bytes, max_errors
        self.result = BatchCheck()
        self.seen: dict[bytes, int] = {}  # digest of a custom_id -> its first line

    def error(self, code: str, message: str, line: int | None, param: str | None = None) -> None:
        if len(self.result.errors) >= self.max_errors:
            self.result.truncated = True
            raise _Stop
        self.result.errors.append(LineError(code, message, line, param))

    def line(self, number: int, raw: bytes) -> None:
        if len(raw) > self.max_line_bytes:
            self.count(number)
            self.error("line_too_long", f"line is more than the limit of {self.max_line_bytes} bytes "
                       "(BATCHINFER_MAX_LINE_BYTES)", number)
            return
        if number == 1 and raw.startswith(_BOM):
            raw = raw[len(_BOM):]
        raw = raw.strip()
        if not raw:
            return  # blank lines are no requests (as `batchinfer submit` reads JSONL)
        self.count(number)
        try:
            obj = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError:
            self.error("invalid_json_line", "This line is not valid UTF-8.", number)
            return
        except (ValueError, RecursionError):
            self.error("invalid_json_line", "This line is not parseable as valid JSON.", number)
            return
        if not isinstance(obj, dict):
            self.error("invalid_json_line", f"This line is JSON but not an object (a {_kind(obj)}).", number)
            return
        self.request(number, obj)

    def count(self, number: int) -> None:
        self.result.requests += 1
        if self.result.requests > self.max_requests:
            self.result.errors.append(LineError(
                "too_many_tasks", f"The batch input file has more than {self.max_requests} requests "
                f"(line {number} is request {self.result.requests}); split it into several batches.", None))
            raise _Stop

    def request(self, number: int, obj: dict[str, Any]) -> None:
        missing = [name for name in _LINE_FIELDS if name not in obj]
        for name in missing:
            self.error("missing_required_parameter", f"Missing required parameter: '{name}'.", number, name)
        custom_id, method, url, body = (obj.get(name) for name in _LINE_FIELDS)
        if "custom_id" not in missing:
            self.custom_id(number, custom_id)
        if "method" not in missing and (not isinstance(method, str) or method.upper() != "POST"):
            self.error("invalid_method", f"Invalid method {_short(method)}: batch requests use 'POST'.",
                       number, "method")
        if "url" not in missing and url != self.endpoint:
            self.error("url_mismatch", f"The url {_short(url)} does not match the batch's endpoint "
                       f"'{self.endpoint}'.", number, "url")
        if "body" in missing:
            return
        if not isinstance(body, dict):
            self.error("invalid_value", f"'body' must be an object, got a {_kind(body)}.", number, "body")
            return
        self.model(number, body)

    def custom_id(self, number: int, custom_id: Any) -> None:
        if not isinstance(custom_id, str) or not custom_id or len(custom_id) > MAX_CUSTOM_ID_CHARS:
            self.error("invalid_value", f"'custom_id' must be a non-empty string of at most "
                       f"{MAX_CUSTOM_ID_CHARS} characters, got {_short(custom_id)}.", number, "custom_id")
            return
        digest = hashlib.blake2b(custom_id.encode("utf-8", "surrogatepass"), digest_size=16).digest()
        first = self.seen.setdefault(digest, number)
        if first != number:
            self.error("duplicate_custom_id", f"The custom_id {_short(custom_id)} is a duplicate of line "
                       f"{first}'s: each request of a batch needs its own custom_id.", number, "custom_id")

    def model(self, number: int, body: dict[str, Any]) -> None:
        model = body.get("model")
        if model is None:
            self.error("missing_required_parameter", "Missing required parameter: 'body.model'.", number,
                       "body.model")
        elif not isinstance(model, str) or not model:
            self.error("invalid_value", f"'body.model' must be a non-empty string, got {_short(model)}.",
                       number, "body.model")
        elif self.result.model is None:
            self.result.model = model
        elif model != self.result.model:
            self.error("model_mismatch", f"The model {_short(model)} differs from the batch's "
                       f"{_short(self.result.model)} (the first request's): a batch runs one model.",
                       number, "body.model")


def validate_batch_lines(lines: Iterable[bytes], endpoint: str, *, max_requests: int, max_line_bytes: int,
                         max_errors: int = 100) -> BatchCheck:
    """Check an OpenAI batch input file, given as its lines (bytes, with or without their newline),
    for a batch of ``endpoint``; see the module docstring for the codes.

    ``max_line_bytes``: a longer line is ``line_too_long`` (a reader that cuts over-long lines may
    pass only their first ``max_line_bytes + 1`` bytes). Stops at the ``max_errors``-th error and at
    request ``max_requests + 1``.
    """
    checker = _Checker(endpoint, max_requests, max_line_bytes, max_errors)
    try:
        for number, raw in enumerate(lines, start=1):
            checker.line(number, raw)
    except _Stop:
        return checker.result
    if checker.result.requests == 0:
        checker.result.errors.append(LineError(
            "empty_file", "The batch input file is empty: it needs at least one request.", None))
    return checker.result


def _kind(value: Any) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", int: "number",
            float: "number", type(None): "null"}.get(type(value), type(value).__name__)


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value) if isinstance(value, str) else json.dumps(value)
    return text if len(text) <= limit else text[:limit] + "..."
