"""How the CLI shows records to people (``--json`` prints the records' dicts instead). Pure."""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence

from batchinfer.jobstore import JobRecord
from batchinfer.registry import WorkerInfo

_STAGES = ("in_progress_at", "finalizing_at", "completed_at", "failed_at", "expired_at", "cancelling_at",
           "cancelled_at")


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
    if not records:
        return "no jobs"
    lines = []
    for r in records:
        c = r.request_counts
        lines.append(f"{r.id}  {r.status.value:<11}  {c['completed'] + c['failed']}/{c['total']}  "
                     f"failed {c['failed']}  {fmt_time(r.created_at)}  {r.input_name or '-'}")
    return "\n".join(lines)


def workers_text(workers: Sequence[WorkerInfo]) -> str:
    """``batchinfer workers``: one line per live worker."""
    if not workers:
        return "no live workers"
    lines = []
    for w in workers:
        cap = w.capacity
        lines.append(f"{w.name}  model={w.model}  device={w.info.get('device', '-')}  "
                     f"max_seqs={cap.get('max_num_seqs', '-')}  kv_tokens={cap.get('kv_tokens', '-')}  "
                     f"heartbeat={fmt_time(w.heartbeat_at)}")
    return "\n".join(lines)
