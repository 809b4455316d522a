"""Batch entries of ``{p}:batches:<model>`` (docs/protocol.md, "Batch entry"): both directions.

The scheduler's dispatch and lease re-dispatch and a worker's engine-failure retries write them
(:func:`encode`, :func:`encode_raw`, :func:`retry_batches`); workers read them (:func:`decode`).
An entry is ``v`` (the protocol version), ``requests`` (a JSON list of ``BatchRequest`` objects)
and, optionally, ``solo`` = ``1``. Pure data: nothing here touches Redis.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from batchinfer.protocol import compact_json
from batchinfer.protocol.entries import PROTOCOL_VERSION
from batchinfer.protocol.rows import BatchRequest, fields_dict

__all__ = ["REQUESTS_FIELD", "SOLO", "SOLO_FIELD", "VERSION_FIELD", "BatchEntry", "MalformedBatch",
           "Rejected", "decode", "encode", "encode_raw", "encode_request", "retry_batches"]

VERSION_FIELD = "v"
REQUESTS_FIELD = "requests"
SOLO_FIELD = "solo"  # present (= SOLO) only on a batch whose requests run alone
SOLO = "1"

# Redis hands field names and values back as bytes (our clients do not decode responses).
_VERSION, _REQUESTS, _SOLO = VERSION_FIELD.encode(), REQUESTS_FIELD.encode(), SOLO_FIELD.encode()


class MalformedBatch(ValueError):
    """An entry that is no batch at all (wrong version, no ``requests`` list): dead-letter it whole."""


@dataclass
class Rejected:
    """A malformed element of a batch entry: routable ones (job and idx known) get an error row."""

    item: Any
    reason: str

    @property
    def route(self) -> tuple[str, int] | None:
        item = self.item if isinstance(self.item, dict) else {}
        job, idx = item.get("job_id"), item.get("idx")
        if isinstance(job, str) and isinstance(idx, int) and not isinstance(idx, bool) and idx >= 0:
            return job, idx
        return None


@dataclass
class BatchEntry:
    """A decoded batch entry: its well-formed requests, its malformed elements, and ``solo``."""

    requests: list[BatchRequest] = field(default_factory=list)
    rejected: list[Rejected] = field(default_factory=list)
    solo: bool = False


#: BatchRequest fields only an embeddings element carries (absent: task "generate").
_EMBED_FIELDS = ("task", "inputs", "pooling_params")


def encode_request(request: BatchRequest) -> str:
    """One element of ``requests``, as compact JSON (staging stores requests in this form too)."""
    # fields_dict, not to_dict: a hot path (every request passes here twice), encoded right away
    values = fields_dict(request)
    if request.task == "generate":  # a generation element is written as before embeddings existed
        for name in _EMBED_FIELDS:
            del values[name]
    if values["lora"] is None:  # a base-model element is written as before adapters existed
        del values["lora"]
    if values["tools"] is None:  # and one without tools as before tool calling existed
        del values["tools"]
    if values["tenant"] is None:  # and one of a job without a tenant as before tenants existed
        del values["tenant"]
    return compact_json.dumps(values)


def encode_raw(encoded: list[str], *, solo: bool = False) -> dict[str, str]:
    """The XADD fields of a batch of requests already encoded by :func:`encode_request`."""
    fields = {VERSION_FIELD: PROTOCOL_VERSION, REQUESTS_FIELD: "[" + ",".join(encoded) + "]"}
    if solo:
        fields[SOLO_FIELD] = SOLO
    return fields


def encode(requests: list[BatchRequest], *, solo: bool = False) -> dict[str, str]:
    """The XADD fields of a batch entry; ``solo``: its requests run alone (see :func:`retry_batches`)."""
    return encode_raw([encode_request(q) for q in requests], solo=solo)


def retry_batches(requests: list[BatchRequest], max_attempts: int) -> list[dict[str, str]]:
    """Batch entries that send ``requests`` (attempts already counted) back to the workers.

    A request on its last attempt gets a batch of its own marked ``solo``: a worker runs it alone,
    with nothing else in its engine or held, so that if it is the one that keeps killing workers
    only it is dead-lettered, not the requests that happened to share its batches. The others
    share one batch.
    """
    last = [q for q in requests if q.attempts >= max_attempts - 1]
    rest = [q for q in requests if q.attempts < max_attempts - 1]
    return ([encode(rest)] if rest else []) + [encode([q], solo=True) for q in last]


def decode(fields: Mapping[bytes, bytes]) -> BatchEntry:
    """A batch entry as read from Redis; :class:`MalformedBatch` for an entry that is no batch.

    Elements that are not requests, or lack a valid ``request_id`` (or ``idx`` for a job's
    request), are returned in ``rejected`` rather than failing the whole entry.
    """
    if fields.get(_VERSION) != PROTOCOL_VERSION.encode():
        raise MalformedBatch(f"unsupported batch protocol version {fields.get(_VERSION)!r}")
    try:
        items = compact_json.loads(fields[_REQUESTS])
    except KeyError:
        raise MalformedBatch(f"no {REQUESTS_FIELD!r} field") from None
    except ValueError as e:  # also UnicodeDecodeError
        raise MalformedBatch(f"{REQUESTS_FIELD!r} is not JSON: {e}") from None
    if not isinstance(items, list):
        raise MalformedBatch(f"{REQUESTS_FIELD!r} is not a JSON list")
    entry = BatchEntry(solo=fields.get(_SOLO) == SOLO.encode())
    for i, item in enumerate(items):
        try:
            req = BatchRequest.from_dict(item)
        except (TypeError, AttributeError) as e:
            entry.rejected.append(Rejected(item, f"request {i} of the batch is malformed: {e}"))
            continue
        idx_ok = isinstance(req.idx, int) and not isinstance(req.idx, bool) and req.idx >= 0
        if not isinstance(req.request_id, str) or not req.request_id or (req.job_id and not idx_ok):
            entry.rejected.append(Rejected(item, f"request {i} of the batch has no valid request_id / idx"))
            continue
        entry.requests.append(req)
    return entry
