"""Opening a job and noting its job-level errors: the Lua calls the scheduler (job control entries)
and the Python client share, so that both open a job exactly the same way."""

from __future__ import annotations

import redis

from batchinfer.config import Settings
from batchinfer.keys import Keys
from batchinfer.protocol.destinations import check_output
from batchinfer.protocol.entries import JobOp, RequestError
from batchinfer.protocol.rows import now_ms
from batchinfer.store import scripts

MAX_JOB_ERRORS = 100  # lines kept in a job's `errors`


def check_open(op: JobOp, settings: Settings) -> None:
    """Refuse an ``open`` whose ``output`` is not a destination a producer may name
    (:func:`batchinfer.protocol.destinations.check_output`): ``RequestError`` ``invalid_request``,
    field ``output``."""
    output = op.params.get("output")
    if output is None:
        return
    try:
        check_output(output, settings.results_root, settings.output_uri_prefixes)
    except ValueError as e:
        raise RequestError("invalid_request", str(e), field="output",
                           context={"job": op.job_id, "reply_to": op.reply_to}) from None


def open_job(r: redis.Redis, keys: Keys, op: JobOp, settings: Settings) -> bool:
    """Create job ``op.job_id``'s record (``validating``, in ``{p}:jobs``) unless it exists; returns
    whether this call created it (``open_job.lua``). An output the producer may not name is refused
    first (:func:`check_open`), so no record ever holds one written through here."""
    check_open(op, settings)
    args: list[str | int] = [op.job_id, now_ms(), op.completion_window, *op.record_fields()]
    return bool(scripts.register(r, "open_job")(keys=[keys.job(op.job_id), keys.jobs], args=args))


def append_job_error(r: redis.Redis, keys: Keys, job_id: str, message: str) -> bool:
    """Add ``message`` to the job's ``errors`` (at most ``MAX_JOB_ERRORS``; a missing job is not created)."""
    script = scripts.register(r, "append_job_error")
    return bool(script(keys=[keys.job(job_id)], args=[message, MAX_JOB_ERRORS]))
