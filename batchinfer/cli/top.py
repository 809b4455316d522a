"""``batchinfer top``: a live terminal view of workers, jobs in progress and queue depths.

:func:`snapshot_from_redis` reads everything once (bounded reads, see :mod:`batchinfer.store.queue_state`),
:func:`render_top` turns a :class:`Snapshot` into a rich renderable (pure: tests render it to a
string), and :func:`run_top` refreshes it in place until Ctrl-C.
"""

from __future__ import annotations

import io
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import redis
from rich import box
from rich.console import Console, Group, JustifyMethod, RenderableType
from rich.live import Live
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from batchinfer.keys import Keys
from batchinfer.protocol.rows import now_ms
from batchinfer.store import queue_state
from batchinfer.store.jobstore import JobStatus
from batchinfer.store.ownership import SchedulerView, live_schedulers
from batchinfer.store.queue_state import JobView, QueueState, WorkerView
from batchinfer.workers.progress import duration_text

STALE_HEARTBEATS = 3  # a worker silent for this many heartbeat periods is shown in red
WIDE = 120  # from this many columns on, the bars and every column; below, a compact layout (80 fits)


@dataclass
class Snapshot:
    """Everything one frame of ``top`` shows, read at ``taken_at`` (ms since the epoch)."""

    taken_at: int
    workers: list[WorkerView]
    jobs: list[JobView]
    queues: QueueState
    where: str = ""
    heartbeat_seconds: float = 5.0
    held: dict[str, int] = field(default_factory=dict)  # model -> requests held (no worker serves it)
    served: list[str] = field(default_factory=list)  # names live workers serve
    schedulers: list[SchedulerView] = field(default_factory=list)  # live ones, the owner first


def snapshot_from_redis(r: redis.Redis, keys: Keys, *, where: str = "", heartbeat_seconds: float = 5.0,
                        max_jobs: int = 50) -> Snapshot:
    """Read workers, unfinished jobs and queue depths from Redis."""
    return Snapshot(
        taken_at=now_ms(),
        workers=queue_state.live_workers(r, keys),
        jobs=queue_state.active_jobs(r, keys, limit=max_jobs),
        queues=queue_state.queue_state(r, keys),
        where=where,
        heartbeat_seconds=heartbeat_seconds,
        held=queue_state.held_models(r, keys),
        served=queue_state.served_models(r, keys),
        schedulers=live_schedulers(r, keys.schedulers),
    )


def snapshot_to_dict(snapshot: Snapshot) -> dict[str, Any]:
    """A JSON-ready dict of the snapshot (``batchinfer top --once --json``), with rates and ETAs added."""
    data = asdict(snapshot)
    now = snapshot.taken_at
    for job, view in zip(data["jobs"], snapshot.jobs, strict=True):
        served = serving(snapshot, view)
        job.update(done=view.done, rate=view.rate(now), eta_seconds=view.eta_seconds(now, served),
                   served=served)
    for worker, wview in zip(data["workers"], snapshot.workers, strict=True):
        worker["load"] = wview.load
    data["queues"]["intake"]["lag_seconds"] = snapshot.queues.intake.lag_seconds(now)
    return data


def serving(snapshot: Snapshot, job: JobView) -> bool:
    """Whether a live worker serves ``job``'s model (by its name or an alias); for a job that names
    no model (its lines do), whether any worker is live. Without one nothing runs: no ETA."""
    names = {*snapshot.served, *(w.model for w in snapshot.workers)}
    return job.model in names if job.model else bool(names)


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def _usage_cell(usage: float | None, wide: bool) -> RenderableType:
    if usage is None:
        return Text("-")
    if not wide:
        return Text(_percent(usage))
    cell = Table.grid(padding=(0, 1))
    cell.add_row(ProgressBar(total=1.0, completed=usage, width=10), _percent(usage))
    return cell


def _table(title: str, columns: tuple[tuple[str, JustifyMethod], ...], wide: bool,
           key_width: int = 0) -> Table:
    """A table whose cells are never cut short ("…"): the first column (a job id) is as wide as its
    longest value, the others fold onto a second line when they must, and the headers are short
    enough for 80 columns."""
    table = Table(title=title, title_justify="left", expand=True,
                  box=box.HEAVY_HEAD if wide else box.SIMPLE_HEAD, padding=(0, 1), pad_edge=wide)
    for i, (name, justify) in enumerate(columns):
        table.add_column(name, justify=justify, no_wrap=i == 0 and key_width > 0, overflow="fold",
                         min_width=max(len(name), key_width if i == 0 else 0))
    return table


def _spec_cell(w: WorkerView) -> str:
    """``71% 2.85``: the share of draft tokens accepted and the mean accepted length (tokens a
    drafting sequence gains per step); ``-`` for a worker that has not drafted."""
    if w.spec_acceptance is None or w.spec_accepted_len is None:
        return "-"
    return f"{w.spec_acceptance:.0%} {w.spec_accepted_len:.2f}"


def _workers_table(snap: Snapshot, wide: bool) -> Table:
    # the speculation column only while a worker speculates: others never need the room
    spec = any(w.spec_acceptance is not None for w in snap.workers)
    columns: tuple[tuple[str, JustifyMethod], ...] = (
        ("worker", "left"), ("model", "left"), ("device", "left"), ("load", "right"),
        ("waiting" if wide else "wait", "right"), ("tokens/s" if wide else "tok/s", "right"),
        *((("spec acc/len" if wide else "spec", "right"),) if spec else ()),
        ("KV use" if wide else "KV", "left"), ("heartbeat" if wide else "seen", "right"))
    table = _table("workers", columns, wide)
    for w in snap.workers:
        age = max(0.0, (snap.taken_at - w.heartbeat_at) / 1000)
        stale = age > STALE_HEARTBEATS * snap.heartbeat_seconds
        load = "-" if w.running is None else (
            f"{w.running}/{w.max_num_seqs}" + (f" ({_percent(w.load)})" if wide else "")
            if w.max_num_seqs else str(w.running))
        table.add_row(
            w.name, w.model, w.device or "-", load, "-" if w.waiting is None else str(w.waiting),
            "-" if w.tokens_per_s is None else f"{w.tokens_per_s:,.1f}" if wide else f"{w.tokens_per_s:,.0f}",
            *((_spec_cell(w),) if spec else ()),
            _usage_cell(w.kv_usage, wide),
            Text(duration_text(age) + (" ago" if wide else ""), style="bold red" if stale else ""),
        )
    if not snap.workers:
        table.add_row(Text("no live workers", style="dim"), *[""] * 7)
    return table


def _jobs_table(snap: Snapshot, wide: bool) -> Table:
    # compact: the model under the job id, and no bar, so that the full id and every column fit 80
    columns: tuple[tuple[str, JustifyMethod], ...] = (
        *((("job", "left"), ("model", "left")) if wide else (("job / model", "left"),)), ("status", "left"),
        *((("progress", "left"),) if wide else ()), ("done/total" if wide else "done", "right"),
        ("failed" if wide else "fail", "right"), ("req/s", "right"), ("ETA", "right"))
    key_width = max((len(j.id) for j in snap.jobs), default=0)
    table = _table("jobs in progress", columns, wide, key_width=key_width)
    for j in snap.jobs:
        total = j.known_total
        rate = j.rate(snap.taken_at)
        served = serving(snap, j)
        eta = j.eta_seconds(snap.taken_at, served)
        shown_total = str(total) if j.total is not None else f"{total}+"  # still submitting
        key = (j.id, j.model or "-") if wide else (Text.assemble(j.id, "\n", (j.model or "-", "dim")),)
        bar = (ProgressBar(total=max(total, 1), completed=j.done, width=20),) if wide else ()
        table.add_row(
            *key, j.status, *bar, f"{j.done}/{shown_total}",
            Text(str(j.failed), style="red" if j.failed else ""),
            "-" if rate is None else f"{rate:,.1f}",
            Text(f"{j.held} held", style="yellow") if j.held else
            Text("no worker", style="yellow") if not served and j.status == JobStatus.IN_PROGRESS
            else duration_text(eta),
        )
    if not snap.jobs:
        table.add_row(Text("no jobs in progress", style="dim"), *[""] * (len(columns) - 1))
    return table


def _queues_table(snap: Snapshot, wide: bool) -> Table:
    columns: tuple[tuple[str, JustifyMethod], ...] = (
        ("queue", "left"), ("waiting", "right"), ("taken, not done" if wide else "taken", "right"),
        ("oldest waiting" if wide else "oldest", "right"))
    table = _table("queues", columns, wide)
    intake = snap.queues.intake
    table.add_row("intake (requests)", str(intake.undelivered), str(intake.unacked),
                  duration_text(intake.lag_seconds(snap.taken_at)) if intake.undelivered else "-")
    for model, state in sorted(snap.queues.batches.items()):
        table.add_row(f"batches: {model}", str(state.undelivered), str(state.unacked),
                      duration_text(state.lag_seconds(snap.taken_at)) if state.undelivered else "-")
    dead = snap.queues.deadletter
    table.add_row("dead letters", Text(str(dead), style="bold red" if dead else ""), "-", "-")
    return table


def _held_lines(snap: Snapshot) -> list[Text]:
    """``3 held: model 'x' is not served; served: a, b``, one per model requests wait for."""
    from batchinfer.cli.render import held_text

    return [Text(held_text(n, model, snap.served), style="bold yellow")
            for model, n in snap.held.items() if n]


def scheduler_text(schedulers: list[SchedulerView]) -> Text:
    """``scheduler HOST:PID (+1 standing by)`` (with partitions: ``schedulers A (partitions 0, 2), B
    (partitions 1, 3)``), or a warning that no scheduler is running."""
    if not schedulers:
        return Text("no scheduler is running: nothing is dispatched (batchinfer scheduler)", style="bold red")
    owners = [s for s in schedulers if s.owner]
    standby = len(schedulers) - len(owners)
    extra = f" (+{standby} standing by)" if standby else ""
    if not owners:
        return Text(f"{standby} scheduler(s) standing by, none owns the work yet", style="bold yellow")
    if [s.partitions for s in owners] == [(0,)]:  # one partition: one owner
        return Text(f"scheduler {owners[0].token.rsplit(':', 1)[0]}{extra}")
    shown = ", ".join(f"{s.token.rsplit(':', 1)[0]} ({_partitions(s.partitions)})" for s in owners)
    return Text(f"schedulers {shown}{extra}")


def _partitions(owned: tuple[int, ...]) -> str:
    return f"partition{'s' if len(owned) > 1 else ''} {', '.join(map(str, owned))}"


def render_top(snapshot: Snapshot, width: int | None = None) -> RenderableType:
    """One frame: a header line, requests held for unserved models, then the workers, jobs and
    queues tables; compact below :data:`WIDE` columns (``width`` None: wide)."""
    wide = width is None or width >= WIDE
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(snapshot.taken_at / 1000))
    header = Text.assemble(("batchinfer top", "bold"), f"  {snapshot.where}  {stamp}  ",
                           f"{len(snapshot.workers)} worker(s), {len(snapshot.jobs)} job(s) in progress")
    return Group(header, scheduler_text(snapshot.schedulers), *_held_lines(snapshot),
                 _workers_table(snapshot, wide), _jobs_table(snapshot, wide), _queues_table(snapshot, wide))


def render_to_text(snapshot: Snapshot, width: int = 120) -> str:
    """The frame as plain text (for ``--once`` without a terminal, and for tests)."""
    out = io.StringIO()
    Console(width=width, file=out, color_system=None).print(render_top(snapshot, width))
    return out.getvalue()


def run_top(r: redis.Redis, keys: Keys, refresh: float = 1.0, *, where: str = "",
            heartbeat_seconds: float = 5.0, console: Console | None = None, frames: int | None = None) -> int:
    """Redraw every ``refresh`` seconds until Ctrl-C (or ``frames`` frames); returns the exit code.

    A Redis error shows in the frame and the view keeps retrying: ``top`` is for watching outages too.
    """
    if refresh <= 0:
        raise ValueError(f"refresh must be > 0 seconds, got {refresh}")

    console = console or Console()

    def frame() -> RenderableType:
        try:
            return render_top(snapshot_from_redis(r, keys, where=where, heartbeat_seconds=heartbeat_seconds),
                              console.width)
        except (redis.RedisError, OSError) as exc:
            return Text(f"batchinfer top  {where}: cannot read Redis ({type(exc).__name__}: {exc}); retrying",
                        style="bold red")

    shown = 0
    try:
        with Live(frame(), console=console, refresh_per_second=4, screen=False) as live:
            shown = 1
            while frames is None or shown < frames:
                time.sleep(refresh)
                live.update(frame())
                shown += 1
    except KeyboardInterrupt:
        pass
    return 0


__all__ = ["Snapshot", "render_to_text", "render_top", "run_top", "serving", "snapshot_from_redis",
           "snapshot_to_dict"]
