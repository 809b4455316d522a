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
    """Refuse an ``open`` whose ``output`` or ``error_output`` is not a destination a producer may
    name (:func:`batchinfer.protocol.destinations.check_output` against ``settings.output_prefixes()``),
    or whose two are one file: ``RequestError`` ``invalid_request``, field ``output`` / ``error_output``.
    A ``partition_by`` needs ``kept``, an ``output`` and the ``parquet`` or ``jsonl`` format (field
    ``partition_by``)."""
    context = {"job": op.job_id, "reply_to": op.reply_to}
    for name in ("output", "error_output"):
        value = op.params.get(name)
        if value is None:
            continue
        try:
            check_output(value, settings.results_root, settings.output_prefixes())
        except ValueError as e:
            raise RequestError("invalid_request", f"{name}: {e}" if name != "output" else str(e), field=name,
                               context=context) from None
    if op.params.get("error_output") is not None and op.params.get("error_output") == op.params.get("output"):
        raise RequestError("invalid_request", "error_output must not be the output itself",
                           field="error_output", context=context)
    if op.params.get("partition_by"):
        _check_partitioned(op, context)


def _check_partitioned(op: JobOp, context: dict) -> None:
    """A partitioned output is a dataset root of Parquet or JSONL files partitioned on kept columns."""
    fmt = op.params.get("output_format", "parquet")
    problem = ("needs kept columns (kept): the partition values come from the kept table"
               if not op.params.get("kept") else
               "needs an output (the dataset root: a folder or URI)" if not op.params.get("output") else
               f"needs output_format parquet or jsonl, not {fmt}" if fmt not in ("parquet", "jsonl") else
               "does not take an error_output (every row goes to its partition)"
               if op.params.get("error_output") else None)
    if problem:
        raise RequestError("invalid_request", f"partition_by {problem}", field="partition_by",
                           context=context)


def open_job(r: redis.Redis, keys: Keys, op: JobOp, settings: Settings) -> bool:
    """Create job ``op.job_id``'s record (``validating``, in ``{p}:jobs``) unless it exists; returns
    whether this call created it (``open_job.lua``). An output the producer may not name is refused
    first (:func:`check_open`), so no record ever holds one written through here."""
    check_open(op, settings)
    args: list[str | int] = [op.job_id, now_ms(), op.completion_window, *op.record_fields()]
    keys = keys.for_job(op.job_id)  # the record and its index entry: the job's partition
    return bool(scripts.register(r, "open_job")(keys=[keys.job(op.job_id), keys.jobs], args=args))


def append_job_error(r: redis.Redis, keys: Keys, job_id: str, message: str) -> bool:
    """Add ``message`` to the job's ``errors`` (at most ``MAX_JOB_ERRORS``; a missing job is not created)."""
    script = scripts.register(r, "append_job_error")
    return bool(script(keys=[keys.job(job_id)], args=[message, MAX_JOB_ERRORS]))
