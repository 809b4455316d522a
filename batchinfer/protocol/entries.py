"""The wire protocol, version 1 (docs/protocol.md): intake entries (requests and job control
``op`` entries), the URL and field-name constants, job ids and :class:`RequestError`. Batch
requests and result rows are in :mod:`batchinfer.protocol.rows`.

Request bodies are validated in :mod:`batchinfer.protocol.bodies`. Nothing here touches Redis.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["PROTOCOL_VERSION", "IntakeEntry", "JobOp", "RequestError", "parse_duration", "parse_entry",
           "parse_partition_by", "valid_job_id"]

PROTOCOL_VERSION = "1"

CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"
EMBEDDINGS_URL = "/v1/embeddings"
RESPONSES_URL = "/v1/responses"  # an OpenAI Batch line of the Responses API (protocol/responses_in.py)
MESSAGES_URL = "/v1/messages"  # RequestSpec.url of an Anthropic Message Batches line (anthropic_in)
OPENAI_LINE_FIELDS = ("custom_id", "method", "url", "body")
ANTHROPIC_LINE_FIELDS = ("custom_id", "params")
# Body fields that are not sampling parameters.
REQUEST_FIELDS = ("custom_id", "model", "prompt", "prompt_token_ids", "messages", "priority", "metadata")
# Embedding body fields besides custom_id, model, priority, metadata (PoolingParams' fields + input).
EMBED_FIELDS = ("input", "encoding_format", "dimensions", "pooling_type", "normalize",
                "truncate_prompt_tokens")
MAX_EMBED_INPUTS = 2048  # inputs of one embeddings request (OpenAI's limit)
# OpenAI fields accepted and ignored: they change nothing about the generated tokens (billing,
# storage, end-user ids, stream options of a batch that has no stream, reasoning of a model without
# it). Each with the JSON type OpenAI documents for it (a wrong type is still an error).
IGNORED_OPENAI_FIELDS: dict[str, type] = {"user": str, "store": bool, "service_tier": str,
                                          "stream_options": dict, "reasoning_effort": str,
                                          "safety_identifier": str, "prompt_cache_key": str}
# Chat body fields of tool calling (validated by batchinfer.workers.tools.parse_tools).
TOOL_FIELDS = ("tools", "tool_choice", "parallel_tool_calls")
# Content part types of a message that carry something else than text; the refusal says why.
NON_TEXT_PARTS = ("image_url", "input_audio", "file")
TEXT_ONLY = "this model takes text only"
# Body fields that constrain the output (batchinfer.protocol.structured_bodies): OpenAI's, vLLM's
# and vLLM's older names; all map onto SamplingParams.structured_outputs. The options come last.
STRUCTURED_FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                     "guided_grammar")
STRUCTURED_OPTION_FIELDS = ("guided_decoding_backend", "guided_whitespace_pattern")
MESSAGE_ROLES = ("system", "developer", "user", "assistant", "tool")
MESSAGE_FIELDS = ("role", "content", "name", "tool_calls", "tool_call_id")
MAX_CUSTOM_ID_CHARS = 512
# Bounds of an entry's own fields (producers are untrusted: every size they send has a bound).
# idx and line must fit int64 (Parquet) and a JSON number a JavaScript producer reads exactly; a
# job's idx is further bounded by BATCHINFER_MAX_REQUESTS_PER_JOB at the scheduler.
MAX_ENTRY_INT = 2**53 - 1
MAX_KEY_FIELD_CHARS = 512  # reply_to and client_request_id become parts of Redis key names
MAX_HOLD_SECONDS = 30 * 86400  # a request waits at most this long for its model
# {p}:cancelled:requests: cancels of direct requests older than this are ignored, and trimmed
CANCEL_KEEP_SECONDS = 3600
MAX_WINDOW_SECONDS = 366 * 86400  # completion_window
MAX_PRIORITY = 2**31  # |priority| of a job or a request
ENTRY_FIELDS = ("v", "body", "job", "idx", "line", "reply_to", "client_request_id", "hold_seconds",
                "priority")
# Job control entries (`op`): what each takes besides v, op, job and reply_to.
OP_FIELDS = {"open": ("model", "completion_window", "priority", "output", "output_format", "metadata",
                      "input_name", "error_output", "tenant", "kept", "partition_by", "unit"),
             "close": ("total",),
             "cancel": ()}
OUTPUT_FORMATS = ("parquet", "jsonl", "openai", "anthropic")
MAX_PARTITION_COLUMNS = 8  # partition_by columns of a job: each is a folder level of its output
MAX_COLUMN_CHARS = 128
_FLAGS = {"1": True, "true": True, "0": False, "false": False}
_DURATION = re.compile(r"^\s*(\d+)\s*([smhd]?)\s*$")
_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


def renamed_path(chat_field: str, renames: tuple[tuple[re.Pattern[str], str], ...], root: str) -> str:
    """The path, under ``root``, of the field of another API's body (Responses, Anthropic) that chat
    body field ``chat_field`` was mapped from: the first of ``renames`` that matches rewrites it."""
    for pattern, repl in renames:
        renamed, n = pattern.subn(repl, chat_field, count=1)
        if n:
            return f"{root}.{renamed}"
    return f"{root}.{chat_field}"


def short_repr(value: Any, limit: int = 60) -> str:
    """``repr(value)`` cut to ``limit`` characters: how an error message quotes a bad value."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def kind_name(value: Any) -> str:
    """What a JSON value is, in words ("an object", "a list", "null", ...), for error messages."""
    return {dict: "an object", list: "a list", str: "a string", type(None): "null", bool: "a boolean",
            int: "an integer", float: "a number"}.get(type(value), type(value).__name__)


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


def _decode(raw: Mapping[bytes, bytes] | Mapping[str, str]) -> tuple[dict[str, str], list[str]]:
    """An entry's fields as text, each decoded alone (so a bad body still leaves job / idx readable),
    and the names of those that are not UTF-8."""
    fields_: dict[str, str] = {}
    not_utf8: list[str] = []
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
    return fields_, not_utf8


def _check_version(fields_: dict[str, str], not_utf8: list[str], fail) -> None:
    if not_utf8:
        raise fail(f"intake entry field(s) not UTF-8: {', '.join(not_utf8)}", not_utf8[0].split(" ")[0])
    if "v" not in fields_:
        raise fail("intake entry has no protocol version field 'v' (not a batchinfer entry?)", "v")
    if fields_["v"] != PROTOCOL_VERSION:
        raise fail(f"unsupported protocol version v={fields_['v']!r} (this build speaks "
                   f"v={PROTOCOL_VERSION})", "v")


def parse_entry(raw: Mapping[bytes, bytes] | Mapping[str, str]) -> IntakeEntry | JobOp:
    """An intake entry: a request (:class:`IntakeEntry`) or, with an ``op`` field, a :class:`JobOp`."""
    if b"op" in raw or "op" in raw:
        return JobOp.from_fields(raw)
    return IntakeEntry.from_fields(raw)


@dataclass
class IntakeEntry:
    """One entry of the intake stream ``{bi}:requests``: a raw body plus routing fields."""

    body: str
    job_id: str | None = None
    idx: int | None = None
    line: int | None = None
    reply_to: str | None = None
    client_request_id: str | None = None
    hold_seconds: float | None = None  # how long to wait for an unserved model (None: the default)
    # The request's priority, over its body's and its job's (None: theirs): a direct request has no
    # job, and Responses / Anthropic bodies have no priority field (the HTTP API's sync requests).
    priority: int | None = None

    def to_fields(self) -> dict[str, str]:
        """The XADD field map (absent optional fields are left out)."""
        out = {"v": PROTOCOL_VERSION, "body": self.body}
        for name, value in (("job", self.job_id), ("idx", self.idx), ("line", self.line),
                            ("reply_to", self.reply_to), ("client_request_id", self.client_request_id),
                            ("hold_seconds", self.hold_seconds), ("priority", self.priority)):
            if value is not None:
                out[name] = f"{value:g}" if isinstance(value, float) else str(value)
        return out

    @classmethod
    def from_fields(cls, raw: Mapping[bytes, bytes] | Mapping[str, str]) -> IntakeEntry:
        """Parse an XREADGROUP entry; a foreign or malformed entry is a ``protocol_error``."""
        fields_, not_utf8 = _decode(raw)
        context: dict[str, Any] = {k: fields_[k] for k in ("job", "idx", "line", "reply_to") if k in fields_}
        for k in ("idx", "line"):  # best effort, for the error row
            if k in context:
                context[k] = _int_or_none(context[k])
        line: int | None = context.get("line")

        def fail(message: str, fld: str | None = None) -> RequestError:
            return RequestError("protocol_error", message, field=fld, line=line, context=context)

        _check_version(fields_, not_utf8, fail)
        unknown = sorted(set(fields_) - set(ENTRY_FIELDS))
        if unknown:
            raise fail(f"unknown intake field(s): {', '.join(unknown)}", unknown[0])
        if "body" not in fields_:
            raise fail("intake entry has no 'body' field", "body")
        job = fields_.get("job") or None
        if job is not None and not valid_job_id(job):
            raise fail(f"job id {job!r} is invalid (letters, digits, '.', '_', '-'; at most 128)", "job")
        idx = line_no = hold = priority = None
        if "idx" in fields_:
            idx = _int_or_none(fields_["idx"])
            if idx is None or not 0 <= idx <= MAX_ENTRY_INT:
                raise fail(f"idx must be a non-negative integer (at most {MAX_ENTRY_INT}), got "
                           f"{_clip(fields_['idx'])}", "idx")
            if job is None:
                raise fail("an entry with 'idx' needs 'job' (the job it belongs to); a direct request has "
                           "neither", "job")
        if job is not None and idx is None:
            raise fail("an entry with a job id needs 'idx' (its index in the job)", "idx")
        if "line" in fields_:
            line_no = _int_or_none(fields_["line"])
            if line_no is None or not 1 <= line_no <= MAX_ENTRY_INT:
                raise fail(f"line must be a positive integer (at most {MAX_ENTRY_INT}), got "
                           f"{_clip(fields_['line'])}", "line")
        if "hold_seconds" in fields_:
            hold = _seconds_or_none(fields_["hold_seconds"])
            if hold is None or hold > MAX_HOLD_SECONDS:
                raise fail(f"hold_seconds must be a non-negative number of seconds (at most "
                           f"{MAX_HOLD_SECONDS}), got {_clip(fields_['hold_seconds'])}", "hold_seconds")
        if "priority" in fields_:
            priority = _int_or_none(fields_["priority"])
            if priority is None or abs(priority) > MAX_PRIORITY:
                raise fail(f"priority must be an integer in [{-MAX_PRIORITY}, {MAX_PRIORITY}], got "
                           f"{_clip(fields_['priority'])}", "priority")
        for name in ("reply_to", "client_request_id"):
            if len(fields_.get(name, "")) > MAX_KEY_FIELD_CHARS:
                raise fail(f"{name} is {len(fields_[name])} characters, more than {MAX_KEY_FIELD_CHARS}",
                           name)
        return cls(body=fields_["body"], job_id=job, idx=idx, line=line_no,
                   reply_to=fields_.get("reply_to") or None,
                   client_request_id=fields_.get("client_request_id") or None, hold_seconds=hold,
                   priority=priority)


@dataclass
class JobOp:
    """A job control entry (``op`` = ``open``, ``close`` or ``cancel``), applied in stream order.

    ``params`` are validated values: ``open`` takes ``model`` (str), ``completion_window`` (int s),
    ``priority`` (int), ``output``, ``output_format``, ``input_name`` (str), ``metadata``
    (dict of str), ``error_output`` (str: OpenAI's error file, the rows that did not complete; the
    ``output`` then gets the completed ones only), ``tenant`` (a job-id-like name: the jobs of one
    tenant share one fair-share group in the scheduler), ``kept`` (bool: the submitter wrote a kept
    table of input columns that the exporter joins to the rows by idx), ``partition_by`` (list of
    column names: the output is a Hive-partitioned dataset on those kept columns) and ``unit`` (a
    job-id-like name: the unit of work whose manifest the export writes); ``close`` takes ``total`` (int).
    """

    op: str
    job_id: str
    params: dict[str, Any]
    reply_to: str | None = None

    @classmethod
    def open(cls, job_id: str, *, model: str | None = None, completion_window: int | str = 24 * 3600,
             priority: int = 0, output: str | None = None, output_format: str = "parquet",
             metadata: Mapping[str, str] | None = None, input_name: str | None = None,
             error_output: str | None = None, tenant: str | None = None, kept: bool = False,
             partition_by: Sequence[str] | None = None, unit: str | None = None) -> JobOp:
        """An ``open`` op; the values are checked as the scheduler checks them (``RequestError``)."""
        given = {"model": model, "completion_window": completion_window, "priority": priority,
                 "output": output, "output_format": output_format, "input_name": input_name,
                 "error_output": error_output, "tenant": tenant,
                 "metadata": json.dumps(dict(metadata), ensure_ascii=False) if metadata else None,
                 "kept": "1" if kept else None, "unit": unit,
                 "partition_by": ",".join(partition_by) if partition_by else None}
        return cls("open", job_id, _op_params("open", {k: str(v) for k, v in given.items() if v is not None},
                                              {}))

    @classmethod
    def close(cls, job_id: str, total: int) -> JobOp:
        return cls("close", job_id, _op_params("close", {"total": str(total)}, {}))

    def to_fields(self) -> dict[str, str]:
        """The XADD field map."""
        out = {"v": PROTOCOL_VERSION, "op": self.op, "job": self.job_id}
        for name, value in self.params.items():
            out[name] = _text(value)
        if self.reply_to:
            out["reply_to"] = self.reply_to
        return out

    def record_fields(self) -> list[str]:
        """An ``open``'s job record fields as a flat name, value list (``open_job.lua``'s ARGV tail)."""
        out: list[str] = []
        for name, value in self.params.items():
            if name != "completion_window":  # the script writes it, with expires_at
                out += [name, _text(value)]
        return out

    @property
    def completion_window(self) -> int:
        return int(self.params.get("completion_window", 24 * 3600))

    @classmethod
    def from_fields(cls, raw: Mapping[bytes, bytes] | Mapping[str, str]) -> JobOp:
        """Parse an ``op`` entry: ``protocol_error`` when malformed, ``invalid_request`` for a bad value."""
        fields_, not_utf8 = _decode(raw)
        context: dict[str, Any] = {k: fields_[k] for k in ("job", "reply_to") if k in fields_}

        def fail(message: str, fld: str | None = None) -> RequestError:
            return RequestError("protocol_error", message, field=fld, context=context)

        _check_version(fields_, not_utf8, fail)
        op = fields_.get("op", "")
        if op not in OP_FIELDS:
            raise fail(f"op must be one of {', '.join(OP_FIELDS)}, got {op!r}", "op")
        allowed = {"v", "op", "job", "reply_to", *OP_FIELDS[op]}
        unknown = sorted(set(fields_) - allowed)
        if unknown:
            raise fail(f"unknown field(s) for op {op}: {', '.join(unknown)} (it takes "
                       f"{', '.join(OP_FIELDS[op]) or 'only job'})", unknown[0])
        job = fields_.get("job") or ""
        if not job:
            raise fail(f"op {op} needs 'job' (the job id)", "job")
        if not valid_job_id(job):
            raise fail(f"job id {job!r} is invalid (letters, digits, '.', '_', '-'; at most 128)", "job")
        return cls(op, job, _op_params(op, fields_, context), fields_.get("reply_to") or None)


def _op_params(op: str, given: Mapping[str, str], context: dict[str, Any]) -> dict[str, Any]:
    """The validated parameters of ``op`` from their text values."""

    def bad(name: str, message: str) -> RequestError:
        return RequestError("invalid_request", f"{name}: {message}", field=name, context=context)

    out: dict[str, Any] = {}
    for name in OP_FIELDS[op]:
        if name not in given:
            continue
        text = given[name]
        if name == "completion_window":
            try:
                out[name] = parse_duration(text)
            except ValueError as e:
                raise bad(name, str(e)) from None
        elif name in ("priority", "total"):
            value = _int_or_none(text)
            low, high = (0, MAX_ENTRY_INT) if name == "total" else (-MAX_PRIORITY, MAX_PRIORITY)
            if value is None or not low <= value <= high:
                kind = (f"a non-negative integer (at most {high})" if name == "total"
                        else f"an integer in [{low}, {high}]")
                raise bad(name, f"must be {kind}, got {_clip(text)}")
            out[name] = value
        elif name == "output_format":
            if text not in OUTPUT_FORMATS:
                raise bad(name, f"must be one of {', '.join(OUTPUT_FORMATS)}, got {text!r}")
            out[name] = text
        elif name == "metadata":
            try:
                meta = json.loads(text)
            except ValueError:
                raise bad(name, f"must be a JSON object of strings, got {text[:80]!r}") from None
            if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
                raise bad(name, "must be a JSON object whose values are strings")
            out[name] = meta
        elif name in ("tenant", "unit") and text and not valid_job_id(text):
            raise bad(name, f"{_clip(text)} is invalid (letters, digits, '.', '_', '-'; at most 128)")
        elif name == "kept":
            if text.lower() not in _FLAGS:
                raise bad(name, f"must be 1, 0, true or false, got {_clip(text)}")
            out[name] = _FLAGS[text.lower()]
        elif name == "partition_by" and text:
            try:
                out[name] = parse_partition_by(text)
            except ValueError as e:
                raise bad(name, str(e)) from None
        elif text:
            out[name] = text
    if op == "close" and "total" not in out:
        raise RequestError("protocol_error", "op close needs 'total' (the number of requests in the job)",
                           field="total", context=context)
    return out


def _text(value: Any) -> str:
    """A parameter's field text: JSON for a dict, ``1`` / ``0`` for a flag, a list comma-joined."""
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, list):
        return ",".join(value)
    return json.dumps(value, ensure_ascii=False) if isinstance(value, dict) else str(value)


def parse_partition_by(text: str) -> list[str]:
    """The column names of a ``partition_by`` field (comma-separated): at most
    :data:`MAX_PARTITION_COLUMNS`, none repeated, each a usable Hive folder key (not empty, at most
    :data:`MAX_COLUMN_CHARS` characters, no ``/``, ``=``, ``,`` or control character, not starting with
    ``.`` or ``_``, which readers take for hidden files); ``ValueError`` naming the bad one."""
    names = text.split(",")
    if len(names) > MAX_PARTITION_COLUMNS:
        raise ValueError(f"at most {MAX_PARTITION_COLUMNS} columns, got {len(names)}")
    for name in names:
        if not name:
            raise ValueError(f"an empty column name in {_clip(text)}")
        if len(name) > MAX_COLUMN_CHARS:
            raise ValueError(f"column name {_clip(name)} is longer than {MAX_COLUMN_CHARS} characters")
        if any(c in "/=" or not c.isprintable() for c in name):
            raise ValueError(f"column name {_clip(name)} holds '/', '=' or a control character")
        if name[0] in "._":
            raise ValueError(f"column name {_clip(name)} starts with '.' or '_' (hidden in a dataset)")
    if len(set(names)) < len(names):
        raise ValueError(f"a column is named twice in {_clip(text)}")
    return names


def parse_duration(value: str | int) -> int:
    """Seconds from ``"24h"``, ``"30m"``, ``"90s"``, ``"2d"`` or a plain number of seconds."""
    if isinstance(value, int) and not isinstance(value, bool):
        seconds = value
    else:
        m = _DURATION.match(str(value))
        if not m:
            raise ValueError(f"completion window {_clip(value)}: use a number with s, m, h or d (e.g. 24h)")
        seconds = int(m.group(1)) * _UNITS[m.group(2)]
    if seconds <= 0:
        raise ValueError(f"completion window must be positive, got {_clip(value)}")
    if seconds > MAX_WINDOW_SECONDS:
        raise ValueError(f"completion window must be at most {MAX_WINDOW_SECONDS} s (366 days), got "
                         f"{_clip(value)}")
    return seconds


_JOB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def valid_job_id(job_id: str) -> bool:
    """Job ids appear in key names and file names: ``[A-Za-z0-9][A-Za-z0-9._-]{0,127}``."""
    return _JOB_ID.fullmatch(job_id) is not None


def _int_or_none(text: str) -> int | None:
    if len(text) > 40:  # int() of a huge digit string is slow (and no bound admits it)
        return None
    try:
        return int(text)
    except (TypeError, ValueError):
        return None


def _clip(value: Any, limit: int = 40) -> str:
    """``repr(value)`` cut to ``limit`` characters: error messages quote what a producer sent."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(str(value))} characters)"


def _seconds_or_none(text: str) -> float | None:
    """A non-negative, finite number of seconds, else None."""
    try:
        value = float(text)
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) and value >= 0 else None
