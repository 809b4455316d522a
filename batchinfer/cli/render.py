"""How the CLI shows records to people (``--json`` prints the records' dicts instead). Pure."""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Sequence
from typing import TypeVar

from batchinfer.store.jobstore import JobRecord, JobStatus
from batchinfer.store.registry import WorkerInfo

_Item = TypeVar("_Item")
# the times a job entered each status after the first, in lifecycle order (``created_at`` is validating's)
_STAGES = tuple(s.timestamp_field.value for s in JobStatus if s is not JobStatus.VALIDATING)


def fmt_time(ms: int | None) -> str:
    """``2025-01-02 10:00:00 UTC`` for ms since the epoch; ``-`` for None."""
    if ms is None:
        return "-"
    return dt.datetime.fromtimestamp(ms / 1000, dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def record_text(record: JobRecord) -> str:
    """``batchinfer status``: one ``key  value`` line per fact, stages in order."""
    counts = record.request_counts
    total = counts["total"] if record.total is not None else f"{counts['total']}+ (submitting)"
    rows = [("job", record.id), ("status", record.status.value), ("model", record.model or "-"),
            ("input", record.input_name or "-"),
            ("requests", f"{counts['completed'] + counts['failed']} of {total} done, "
                         f"{counts['completed']} completed, {counts['failed']} failed"),
            ("created", fmt_time(record.created_at)), ("expires", fmt_time(record.expires_at))]
    for name in _STAGES:
        if getattr(record, name) is not None:
            rows.append((name.removesuffix("_at").replace("_", " "), fmt_time(getattr(record, name))))
    rows.append(("output", record.output or "-"))
    rows += [("error", e) for e in record.errors]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{key:<{width}}  {value}" for key, value in rows)


def jobs_text(records: Sequence[JobRecord]) -> str:
    """``batchinfer jobs``: one line per job, newest first."""
    return _listing(records, "no jobs", _job_line)


def workers_text(workers: Sequence[WorkerInfo]) -> str:
    """``batchinfer workers``: one line per live worker."""
    return _listing(workers, "no live workers", _worker_line)


def _listing(items: Sequence[_Item], empty: str, line: Callable[[_Item], str]) -> str:
    """One ``line(item)`` per item, or ``empty`` when there is none."""
    if not items:
        return empty
    return "\n".join(line(item) for item in items)


def _job_line(r: JobRecord) -> str:
    c = r.request_counts
    return (f"{r.id}  {r.status.value:<11}  {c['completed'] + c['failed']}/{c['total']}  "
            f"failed {c['failed']}  {fmt_time(r.created_at)}  {r.input_name or '-'}")


def _worker_line(w: WorkerInfo) -> str:
    cap = w.capacity
    return (f"{w.name}  model={w.model}  device={w.info.get('device', '-')}  "
            f"max_seqs={cap.get('max_num_seqs', '-')}  kv_tokens={cap.get('kv_tokens', '-')}  "
            f"heartbeat={fmt_time(w.heartbeat_at)}")
