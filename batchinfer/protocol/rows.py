"""What travels after validation: ``BatchRequest`` (an element of a batch entry) and ``ResultRow``
(one result: a results-stream entry, a ``reply_to`` entry, a Parquet row). docs/protocol.md.
"""

from __future__ import annotations

import base64
import json
import sys
import time
from array import array
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from functools import cache
from typing import TYPE_CHECKING, Any

from batchinfer.protocol import compact_json

if TYPE_CHECKING:
    from batchinfer.workers.sampling_params import SamplingParams

ROW_STATUSES = ("completed", "failed", "cancelled", "expired")


def now_ms() -> int:
    """Milliseconds since the epoch (UTC): the protocol's one time unit, and its one clock.

    Integer nanoseconds floored, not ``int(time.time() * 1000)``: a float of today's epoch seconds
    is only ~0.24 us fine, so near the end of a millisecond it rounds up and the product names the
    next one (a timestamp later than the instant it records).
    """
    return time.time_ns() // 1_000_000


TASKS = ("generate", "embed")


def encode_vector(values: Any) -> str:
    """One embedding as the protocol carries it: base64 of little-endian float32 (OpenAI's
    ``encoding_format: "base64"`` form, a third of JSON floats' size and exact).

    ``values``: a sequence of floats, or anything with ``tobytes()`` of float32 (a numpy array).
    """
    if hasattr(values, "tobytes") and getattr(values, "dtype", None) is not None:
        raw = values.astype("<f4", copy=False).tobytes()
    else:
        arr = array("f", values)
        if sys.byteorder == "big":
            arr.byteswap()
        raw = arr.tobytes()
    return base64.b64encode(raw).decode("ascii")


def decode_vector(text: str | bytes) -> list[float]:
    """The floats of :func:`encode_vector`'s text (``ValueError`` if it is not whole float32s)."""
    raw = base64.b64decode(text, validate=True)
    if len(raw) % 4:
        raise ValueError(f"an embedding of {len(raw)} bytes is not a whole number of float32s")
    arr = array("f")
    arr.frombytes(raw)
    if sys.byteorder == "big":
        arr.byteswap()
    return arr.tolist()


def request_id_for(job_id: str | None, idx: int | None, entry_id: str | None = None) -> str:
    """``<job_id>:<idx>`` for a job's request; a direct request is named by its intake entry id."""
    if job_id is not None and idx is not None:
        return f"{job_id}:{idx}"
    if entry_id is None:
        raise ValueError("a direct request needs its intake entry id")
    return entry_id


@cache
def _field_names(cls: type) -> tuple[str, ...]:
    """A dataclass's field names, in order: ``fields()`` builds its tuple anew on every call, and
    every request and row passes here (the worker's prefetch and publisher threads)."""
    return tuple(f.name for f in fields(cls))


@cache
def _field_set(cls: type) -> frozenset[str]:
    return frozenset(_field_names(cls))


def fields_dict(obj: Any) -> dict[str, Any]:
    """A dataclass's fields as a dict *without* ``asdict``'s deep copy: for values encoded right away.

    ``asdict`` recurses into every list element (each token id of a row), which made encoding a
    row cost more than publishing it.
    """
    kind: type = obj.__class__
    return {name: getattr(obj, name) for name in _field_names(kind)}


def _from_mapping(cls, d: Mapping[str, Any]):
    """Build a dataclass from a mapping, ignoring keys a newer writer may have added."""
    names = _field_set(cls)
    if type(d) is dict and names.issuperset(d):  # the usual case: no key to drop, no copy to filter
        return cls(**d)
    return cls(**{k: v for k, v in d.items() if k in names})


@dataclass
class BatchRequest:
    """One request inside a batch entry (``{bi}:batches:<model>``), ready for a worker's engine."""

    request_id: str
    job_id: str | None
    idx: int | None
    prompt_token_ids: list[int]
    sampling_params: dict[str, Any]  # SamplingParams.to_dict()
    model: str
    line: int | None = None
    custom_id: str | None = None
    reply_to: str | None = None
    metadata: dict[str, str] = field(default_factory=dict)
    created_at: int | None = None
    attempts: int = 0
    url: str | None = None  # OpenAI endpoint of an OpenAI Batch line (shapes OpenAI output)
    # Embedding requests (task "embed"): the token ids of each input, one vector each, and
    # PoolingParams.to_dict(); prompt_token_ids is then empty and sampling_params {}.
    task: str = "generate"
    inputs: list[list[int]] | None = None
    pooling_params: dict[str, Any] | None = None
    # The LoRA adapter the request runs with (None: the base model); the scheduler sets it for a
    # request staged under an adapter's model name ``BASE:NAME``.
    lora: str | None = None
    # Function tools of a chat line (ToolSpec.to_dict(), workers/tools): the worker turns the
    # completions' text into tool calls with them. None: no tools.
    tools: dict[str, Any] | None = None
    # The tenant of the request's job (the job record's ``tenant``), set by the scheduler: a tenant's
    # jobs share one fair-share group when batches are packed. None: the job is its own group.
    tenant: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def num_prompt_tokens(self) -> int:
        """The tokens this request puts through the model's prompt pass (every input's, for "embed")."""
        if self.inputs is not None:
            return sum(len(ids) for ids in self.inputs)
        return len(self.prompt_token_ids)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> BatchRequest:
        return _from_mapping(cls, d)

    def params(self) -> SamplingParams:
        """The sampling parameters as a ``SamplingParams`` (validated again)."""
        from batchinfer.workers.sampling_params import SamplingParams

        return SamplingParams.from_dict(self.sampling_params)


@dataclass
class ResultRow:
    """One request's result; the columns of the Parquet output (docs/protocol.md)."""

    job_id: str | None
    request_id: str
    status: str  # completed | failed | cancelled | expired
    idx: int | None = None
    custom_id: str | None = None
    model: str | None = None
    finish_reason: str | None = None  # of the first completion: stop | length | abort
    output_text: str | None = None  # first completion
    output_token_ids: list[int] | None = None  # first completion
    outputs: list[dict[str, Any]] | None = None  # all n completions
    # Structured outputs, of the first completion: the constraint's kind (json, regex, choice, grammar,
    # json_object) and whether its text is a complete match; both None when unconstrained.
    structured: str | None = None
    structured_complete: bool | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None  # over all completions
    cached_tokens: int | None = None
    # Predicted outputs (a chat line's ``prediction``), over all completions: the prediction's draft
    # tokens the model kept and those it verified and rejected; None when the request gave none.
    accepted_prediction_tokens: int | None = None
    rejected_prediction_tokens: int | None = None
    error_code: str | None = None
    error_message: str | None = None
    line: int | None = None
    created_at: int | None = None
    started_at: int | None = None
    finished_at: int | None = None
    worker: str | None = None
    sampling_params: dict[str, Any] | None = None
    metadata: dict[str, str] = field(default_factory=dict)
    url: str | None = None  # OpenAI endpoint of an OpenAI Batch line; not a Parquet column
    # Embedding rows: one vector per input, in input order, each encode_vector()'s base64 float32;
    # pooling_params as the request gave them (encoding_format shapes the OpenAI output line).
    embeddings: list[str] | None = None
    pooling_params: dict[str, Any] | None = None
    # The first completion's tool calls (OpenAI's shape: id, type "function", function.name,
    # function.arguments as a JSON string); None when the request had no tools or made no call.
    tool_calls: list[dict[str, Any]] | None = None

    def __post_init__(self) -> None:
        if self.status not in ROW_STATUSES:
            raise ValueError(f"status must be one of {', '.join(ROW_STATUSES)}, got {self.status!r}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self) -> str:
        # orjson reads the dataclass's fields itself (in order, as fields_dict would give them)
        text = compact_json.dumps(self, default=fields_dict)
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            # A lone surrogate (from a producer that wrote one straight to a batch stream) cannot be
            # sent as UTF-8: escape it rather than leave a row that can never be published.
            text = json.dumps(fields_dict(self), ensure_ascii=True, separators=(",", ":"))
        return text

    @classmethod
    def from_json(cls, text: str | bytes) -> ResultRow:
        return cls.from_dict(json.loads(text))

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ResultRow:
        return _from_mapping(cls, d)

    @property
    def ok(self) -> bool:
        return self.status == "completed"

    def vectors(self) -> list[list[float]] | None:
        """The row's embeddings as floats (None for a generation or error row)."""
        return None if self.embeddings is None else [decode_vector(v) for v in self.embeddings]

    @classmethod
    def error(cls, code: str, message: str, *, status: str = "failed", request: BatchRequest | None = None,
              job_id: str | None = None, idx: int | None = None, request_id: str | None = None,
              line: int | None = None, custom_id: str | None = None, model: str | None = None,
              metadata: Mapping[str, str] | None = None, created_at: int | None = None,
              worker: str | None = None, sampling_params: dict[str, Any] | None = None,
              url: str | None = None) -> ResultRow:
        """An error row (``failed``, ``cancelled`` or ``expired``); fields default from ``request``."""
        if request is not None:
            job_id = job_id if job_id is not None else request.job_id
            idx = idx if idx is not None else request.idx
            request_id = request_id or request.request_id
            line = line if line is not None else request.line
            custom_id = custom_id if custom_id is not None else request.custom_id
            model = model or request.model
            metadata = metadata if metadata is not None else request.metadata
            created_at = created_at if created_at is not None else request.created_at
            sampling_params = sampling_params if sampling_params is not None else request.sampling_params
            url = url or request.url
        if request_id is None:
            request_id = request_id_for(job_id, idx)
        return cls(job_id=job_id, request_id=request_id, status=status, idx=idx, custom_id=custom_id,
                   model=model, error_code=code, error_message=message, line=line, created_at=created_at,
                   finished_at=now_ms(), worker=worker, sampling_params=sampling_params,
                   metadata=dict(metadata or {}), url=url)
