"""How the CLI shows records to people (``--json`` prints the records' dicts instead). Pure."""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Mapping, Sequence
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


def held_text(count: int, model: str | None, served: Sequence[str], loading: bool = False) -> str:
    """``3 held: model 'SmolLM2' is not served; served: hf, qwen`` (``model`` None: the model unknown).

    A model served by now (its worker registered after the requests were held) says so: the
    scheduler's next sweep of the holding area takes them in. ``loading``: a worker for it is
    starting (``run`` started one), so the wait is for its model to load, not for an operator.
    """
    if model and model in served:
        return f"{count} held: model {model!r} is served now; the scheduler takes them in at its next sweep"
    if loading:
        return f"{count} held: a worker is loading {'model ' + repr(model) if model else 'the model'}"
    what = f"model {model!r} is not served" if model else "their model is not served"
    return f"{count} held: {what}; served: {', '.join(served) if served else 'none (no live worker)'}"


def unserved_text(models: Sequence[str], served: Sequence[str]) -> str:
    """``submit``'s warning: ``models`` (named by the job) are served by no live worker, so their
    requests are held until one is; what is served."""
    names, many = ", ".join(repr(m) for m in models), len(models) > 1
    return (f"warning: no live worker serves model{'s' if many else ''} {names}: "
            f"{'their' if many else 'its'} requests are held until one does (up to the completion window); "
            f"served: {', '.join(served) if served else 'none (no live worker)'}")


def _counts_text(record: JobRecord) -> str:
    c = record.request_counts
    total = c["total"] if record.total is not None else f"{c['total']}+ (submitting)"
    parts = [f"{record.done} of {total} done", f"{c['completed']} completed", f"{c['failed']} failed"]
    parts += [f"{c[k]} {k}" for k in ("cancelled", "expired") if c.get(k)]
    return ", ".join(parts)


def record_text(record: JobRecord, served: Sequence[str] | None = None,
                held_models: Sequence[str] = ()) -> str:
    """``batchinfer status``: one ``key  value`` line per fact, stages in order; with ``served``
    (the names live workers serve), a ``held`` line when requests wait for an unserved model,
    naming it: the job's model, else ``held_models`` (those its held requests name)."""
    rows = [("job", record.id), ("status", record.status.value), ("model", record.model or "-"),
            ("input", record.input_name or "-"), ("requests", _counts_text(record))]
    if record.held:
        model = record.model or (held_models[0] if len(held_models) == 1 else None)
        text = held_text(record.held, model, served or [])
        if model is None and held_models:  # lines naming several models, none served
            text = text.replace("their model is not served",
                                f"models {', '.join(repr(m) for m in held_models)} are not served")
        rows.append(("held", text))
    if record.models_overridden:
        rows.append(("model overridden", overridden_text(record)))
    rows += [("created", fmt_time(record.created_at)), ("expires", fmt_time(record.expires_at))]
    for name in _STAGES:
        if getattr(record, name) is not None:
            rows.append((name.removesuffix("_at").replace("_", " "), fmt_time(getattr(record, name))))
    rows.append(("output", record.output or "-"))
    rows += [("error", e) for e in record.errors]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{key:<{width}}  {value}" for key, value in rows)


def overridden_text(record: JobRecord) -> str:
    """``400 lines named another model ('gpt-4o-mini'); the job's model 'SmolLM2' answered them``."""
    n = record.models_overridden
    names = ", ".join(repr(m) for m in record.overridden_models) or "?"
    return (f"{n} line{'s' if n != 1 else ''} named another model ({names}); the job's model "
            f"{record.model!r} answered {'them' if n != 1 else 'it'}")


def jobs_text(records: Sequence[JobRecord], held: Mapping[str, int] | None = None,
              served: Sequence[str] = ()) -> str:
    """``batchinfer jobs``: one line per job, newest first; then one line per model requests are
    held for (``held``: model -> requests, job and direct ones)."""
    text = _listing(records, "no jobs", _job_line)
    notes = [held_text(n, model, served) for model, n in (held or {}).items() if n > 0]
    return "\n".join([text, *notes])


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
    held = f"  held {r.held}" if r.held else ""
    return (f"{r.id}  {r.status.value:<11}  {r.done}/{c['total']}  "
            f"failed {c['failed']}{held}  {fmt_time(r.created_at)}  {r.input_name or '-'}")


def _worker_line(w: WorkerInfo) -> str:
    cap = w.capacity
    return (f"{w.name}  model={w.model}  device={w.info.get('device', '-')}  "
            f"max_seqs={cap.get('max_num_seqs', '-')}  kv_tokens={cap.get('kv_tokens', '-')}  "
            f"heartbeat={fmt_time(w.heartbeat_at)}")
