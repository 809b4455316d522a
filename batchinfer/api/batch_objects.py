"""OpenAI's ``Batch`` object from an API batch and its job's record (pure: no I/O).

Before its job exists a batch is its own record's (``validating``, ``failed`` by validation,
``cancelled`` before it ran); from then on the job record says the rest: the status (OpenAI's
names already), every ``*_at``, the counts, the model and, once the export wrote them, the two
files and the token ``usage``.
"""

from __future__ import annotations

from typing import Any

from batchinfer.protocol.entries import parse_duration
from batchinfer.store.apibatches import ApiBatch, BatchState
from batchinfer.store.jobstore import JobRecord, JobStatus

# the job's times a Batch shows (``created_at`` is the API batch's own: the create call)
_JOB_TIMES = ("in_progress_at", "expires_at", "finalizing_at", "completed_at", "failed_at", "expired_at",
              "cancelling_at", "cancelled_at")


def _seconds(ms: int | None) -> int | None:
    return None if ms is None else ms // 1000


def openai_batch(batch: ApiBatch, record: JobRecord | None) -> dict[str, Any]:
    """``batch`` as an ``openai.types.Batch``; ``record`` is its job's (the job id is the batch id),
    None while it has none.

    ``request_counts.failed`` counts the failed, cancelled and expired requests together (the error
    file's lines, so ``completed + failed == total`` once the batch ended). ``output_file_id`` and
    ``error_file_id`` appear once the export wrote the files (after a cancel or an expiry too: the
    partial output), ``error_file_id`` only when some request did not complete. An expired job
    reads ``finalizing`` until its files are written, so that ``expired`` comes with them.
    """
    out: dict[str, Any] = {
        "id": batch.id, "object": "batch", "endpoint": batch.endpoint, "errors": None,
        "input_file_id": batch.input_file_id, "completion_window": batch.completion_window,
        "status": JobStatus.VALIDATING.value, "output_file_id": None, "error_file_id": None,
        "created_at": _seconds(batch.created_at), **dict.fromkeys(_JOB_TIMES),
        "request_counts": {"total": batch.total or 0, "completed": 0, "failed": 0},
        "metadata": dict(batch.metadata) or None, "usage": None, "model": None,
    }
    if batch.state is BatchState.SUBMITTED and record is not None:
        return _from_job(out, batch, record)
    if batch.state is BatchState.FAILED:
        out.update(status="failed", failed_at=_seconds(batch.ended_at),
                   errors={"object": "list", "data": [_error(e) for e in batch.errors]})
    elif batch.state is BatchState.CANCELLED:
        out.update(status="cancelled", cancelling_at=_seconds(batch.ended_at),
                   cancelled_at=_seconds(batch.ended_at))
    else:  # validating, or submitted with its job about to be opened
        out["expires_at"] = _expires(batch)
    return out


def _from_job(out: dict[str, Any], batch: ApiBatch, record: JobRecord) -> dict[str, Any]:
    unsuccessful = record.failed + record.cancelled + record.expired
    total = record.total if record.total is not None else (batch.total or record.submitted)
    out.update({name: _seconds(getattr(record, name)) for name in _JOB_TIMES})
    out.update(status=record.status.value, model=record.model,
               request_counts={"total": total, "completed": record.completed, "failed": unsuccessful})
    if record.errors:  # job-level errors (an export that failed for good, a submission cut short)
        out["errors"] = {"object": "list", "data": [
            {"code": "batch_error", "message": e, "line": None, "param": None} for e in record.errors]}
    if record.status is JobStatus.EXPIRED and record.exported_at is None:
        # the window closed, but rows still come in and the files are not written: an OpenAI client
        # polls until a final status and then reads the files, so it is not shown final yet
        out.update(status=JobStatus.FINALIZING.value, expired_at=None,
                   finalizing_at=_seconds(record.finalizing_at or record.expired_at))
    if record.exported_at is not None:
        out["output_file_id"] = batch.output_file_id
        out["error_file_id"] = batch.error_file_id if unsuccessful else None
        out["usage"] = record.usage
    return out


def _error(e: dict[str, Any]) -> dict[str, Any]:
    return {name: e.get(name) for name in ("code", "message", "line", "param")}


def _expires(batch: ApiBatch) -> int | None:
    """When a batch not yet submitted will expire: its creation plus its window."""
    try:
        return _seconds(batch.created_at + parse_duration(batch.completion_window) * 1000)
    except ValueError:
        return None
