"""Incremental nightly runs (``batchinfer nightly``): the input's partitions that the output's
manifests do not cover yet, one job each, waited for.

A *unit* is the files of one Hive partition (all keys: ``date=2026-12-03/lang=en``), or one file
when the input is not partitioned. Its id, ``unit_id([input root, partition folder or file path])``,
does not change when the partition's files change; its *fingerprint* (each file's relative path
and size) does. A unit is done when the output root holds a manifest (``_manifests/<unit>.json``,
written by the exporter after the unit's result files) with that unit id and the same
fingerprint: a new partition, or one whose files changed, is processed again; the others are
skipped.

Each unit still to do becomes one job whose id is derived from the unit, its fingerprint and the
output root (:func:`nightly_job_id`; two pipelines reading one input into two outputs do not share
jobs). Two runs started at once against the same queue (cron and a manual start, an Airflow retry)
therefore name the same jobs: the queue opens each once, and the run
that finds a unit's job already open waits for it instead of submitting it again. A job that
exists but ended without writing its unit (failed, cancelled, expired, or completed without the
unit's manifest) is deleted, with its export's rq job, and submitted again, once per run.
Interrupting a run leaves its jobs running: the next run joins them.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from batchinfer.datasets.manifest import Manifest, fingerprint, manifest_path, read_manifests, unit_id
from batchinfer.datasets.source import DatasetFile, DatasetSource, InputError
from batchinfer.datasets.uris import filesystem_for, is_uri, location_of, store_error
from batchinfer.jobs.queueing import forget_export
from batchinfer.store.jobstore import JobRecord, JobStatus

if TYPE_CHECKING:
    from batchinfer.client.client import Client
    from batchinfer.datasets.templates import RequestTemplate

log = logging.getLogger("batchinfer.nightly")

POLL_SECONDS = 1.0  # between two looks at the units' jobs
RETRY_LOCK_MS = 30_000  # while one run checks and deletes an ended job before submitting it again
MAX_START_TRIES = 50  # looks at one unit's job before giving up on starting it (a lost race, each)

SKIPPED, SUBMITTED, JOINED = "skipped", "submitted", "joined"


@dataclass
class NightlyUnit:
    """One unit of a nightly run: the files of a Hive partition, or one file."""

    unit: str  # unit_id([input root, name])
    partition: dict[str, str]  # Hive key -> value ({} when unpartitioned)
    files: list[DatasetFile]
    fingerprint: str  # manifest.fingerprint(files): changes when a file is added, removed or resized
    name: str = ""  # the partition folder ("date=2026-12-03") or the file's path below the input root


@dataclass
class NightlyPlan:
    """The units to process (``todo``) and those the output's manifests cover already (``done``)."""

    todo: list[NightlyUnit]
    done: list[NightlyUnit]


def _unit_name(file: DatasetFile, partitioned: bool) -> str:
    """The partition folder of ``file`` (its ``key=value`` folders, in path order) or, unpartitioned,
    its own path below the input root."""
    if not partitioned:
        return file.relative
    return "/".join(part for part in file.relative.split("/")[:-1] if "=" in part)


def plan_nightly(source: DatasetSource, output: str) -> NightlyPlan:
    """The input's units, split by the manifests under the ``output`` root (a folder or URI).

    ``InputError`` when the input cannot be listed (or a filter matches no file); ``ValueError``
    naming the output when its manifests cannot be read (an unreachable store, wrong credentials).
    """
    partitioned = bool(source.partition_keys)
    groups: dict[str, list[DatasetFile]] = {}
    for file in source.files():
        groups.setdefault(_unit_name(file, partitioned), []).append(file)
    try:
        fs, root_path = filesystem_for(output)
        manifests = read_manifests(fs, root_path)
    except OSError as e:
        raise ValueError(store_error(e, output)) from e
    plan = NightlyPlan(todo=[], done=[])
    for name, files in groups.items():
        unit = NightlyUnit(unit=unit_id([source.root, name]), partition=dict(files[0].partition), files=files,
                           fingerprint=fingerprint(files), name=name)
        written = manifests.get(unit.unit)
        up_to_date = written is not None and written.fingerprint == unit.fingerprint
        (plan.done if up_to_date else plan.todo).append(unit)
    return plan


def check_columns(source: DatasetSource, keep_columns: Sequence[str] | None,
                  partition_by: Sequence[str] | None) -> None:
    """Refuse kept or partition columns that the input does not have, or that clash with result
    columns, before any job is submitted (or any daemon started): ``InputError`` naming them and
    the input's columns, as ``Client.submit`` would refuse each unit's job."""
    from batchinfer.client.client import _check_kept_names  # submit's own rule for the clashes

    schema = source.schema
    for what, names in (("partition_by", partition_by or ()), ("keep", keep_columns or ())):
        unknown = [c for c in names if c not in schema.names]
        if unknown:
            raise InputError(f"{source.name}: {what} column(s) {', '.join(unknown)} are not columns of the "
                             f"input (columns: {', '.join(schema.names)})")
    _check_kept_names(list(dict.fromkeys([*(keep_columns or ()), *(partition_by or ())])))


def nightly_job_id(unit: NightlyUnit, output: str) -> str:
    """The job id of ``unit`` as it is now, written to ``output`` (the result dataset's root):
    ``nightly-<unit>-<8 hex digits of sha256(fingerprint, output root)>``. The same in every run
    that sees the same files and writes to the same place; another one for another output, so two
    pipelines reading one input into two outputs never join each other's jobs."""
    key = f"{unit.fingerprint}\n{output_root(output)}"
    return f"nightly-{unit.unit}-{hashlib.sha256(key.encode()).hexdigest()[:8]}"


def output_root(output: str) -> str:
    """``output`` as one name per place (no store access): a local path or ``file://`` URI as its
    absolute path, another URI without its trailing slashes."""
    if not is_uri(output):
        return os.path.abspath(os.path.expanduser(output))
    if output.lower().startswith("file://"):
        return os.path.abspath(filesystem_for(output)[1])
    return output.rstrip("/")


@dataclass
class UnitReport:
    """What a nightly run did with one unit."""

    unit: str
    name: str
    partition: dict[str, str]
    files: int
    action: str  # skipped (its manifest is up to date) | submitted (by this run) | joined (another run's job)
    job_id: str | None = None
    status: str | None = None  # the job's status when the run ended (None: skipped, or never started)
    rows: int | None = None  # the job's requests
    failed_rows: int = 0  # of those, the rows answered with an error
    manifest: str | None = None  # the unit's manifest, once written
    error: str | None = None  # why the unit was not written
    input_error: bool = False  # the unit's input could not be read

    @property
    def written(self) -> bool:
        """The unit's results and manifest are in the output (before this run or by it)."""
        return self.action == SKIPPED or (self.status == JobStatus.COMPLETED.value and self.error is None)

    def to_dict(self) -> dict[str, Any]:
        return {"unit": self.unit, "name": self.name, "partition": self.partition, "files": self.files,
                "action": self.action, "job_id": self.job_id, "status": self.status, "rows": self.rows,
                "failed_rows": self.failed_rows, "manifest": self.manifest, "error": self.error,
                "written": self.written}


@dataclass
class NightlyReport:
    """The outcome of :func:`run_nightly`: one :class:`UnitReport` per unit of the input."""

    input: str
    output: str
    units: list[UnitReport] = field(default_factory=list)
    timed_out: bool = False  # the timeout passed before every job ended

    @property
    def written(self) -> bool:
        """Every unit is written (or there was none)."""
        return all(u.written for u in self.units)

    @property
    def input_errors(self) -> list[UnitReport]:
        return [u for u in self.units if u.input_error]

    @property
    def failed(self) -> list[UnitReport]:
        """Units whose job ended without writing them."""
        return [u for u in self.units if not u.written and u.status is not None
                and JobStatus(u.status).terminal]

    def to_dict(self) -> dict[str, Any]:
        counts = {action: sum(u.action == action for u in self.units)
                  for action in (SKIPPED, SUBMITTED, JOINED)}
        return {"input": self.input, "output": self.output, "written": self.written,
                "timed_out": self.timed_out, **counts, "units": [u.to_dict() for u in self.units]}


def run_nightly(client: Client | None, source: DatasetSource | str, output: str, *, model: str | None,
                template: RequestTemplate | None = None, keep_columns: Sequence[str] | None = None,
                partition_by: Sequence[str] | None = None, output_format: str = "parquet",
                priority: int = 0, completion_window: str | int = "24h",
                metadata: Mapping[str, str] | None = None, timeout: float | None = None,
                poll_seconds: float = POLL_SECONDS, say: Callable[[str], None] | None = None,
                check: Callable[[], None] | None = None, plan: NightlyPlan | None = None) -> NightlyReport:
    """Process the units of ``source`` that the manifests under ``output`` do not cover, one job
    each (:func:`plan_nightly`, :func:`nightly_job_id`), and wait for them.

    ``source``: a :class:`DatasetSource` (its row filter applies to every unit) or what one takes.
    ``output``: the result dataset's root (a folder or URI the queue may write: a producer's
    destination rule); the jobs write ``partition_by`` Hive partitions and one manifest per unit
    there. ``timeout`` (seconds, for the whole wait): past it the report says ``timed_out`` and
    the jobs go on. ``say(line)`` hears what happens; ``check()`` runs after every poll (it may
    raise to stop waiting). ``partition_by`` is required (``ValueError``: a nightly run writes a
    dataset); kept or partition columns the input lacks are an ``InputError`` before any job is
    submitted (:func:`check_columns`). Redis errors and a refused output (``ValueError``)
    propagate; a unit whose input cannot be read is reported (``input_error``) and the others go on.
    ``plan``: :func:`plan_nightly`'s, when the caller has it already (``client`` may then be None
    if it has nothing to do: ``nightly --embedded`` starts no daemons for nothing).
    """
    if not partition_by:
        raise ValueError("a nightly run writes a dataset: give partition_by (its Hive partition columns)")
    if not isinstance(source, DatasetSource):
        source = DatasetSource(source)
    say = say or (lambda line: None)
    plan = plan if plan is not None else plan_nightly(source, output)
    if plan.todo:
        check_columns(source, keep_columns, partition_by)
    if client is None and plan.todo:
        raise ValueError(f"{len(plan.todo)} unit(s) to process: a client is needed")
    report = NightlyReport(input=source.root, output=output)
    fs, root_path = filesystem_for(output)
    by_unit: dict[str, UnitReport] = {}
    for unit in sorted([*plan.done, *plan.todo], key=lambda u: u.name):
        entry = UnitReport(unit=unit.unit, name=unit.name, partition=unit.partition, files=len(unit.files),
                           action=SKIPPED)
        report.units.append(entry)
        if unit in plan.done:
            entry.manifest = location_of(fs, manifest_path(root_path, unit.unit))
        by_unit[unit.unit] = entry
    say(f"{len(plan.todo)} unit(s) to process, {len(plan.done)} up to date")
    submit: dict[str, Any] = dict(model=model, output=output, output_format=output_format, priority=priority,
                                  completion_window=completion_window, metadata=metadata, template=template,
                                  keep_columns=keep_columns, partition_by=partition_by)
    if client is None:
        return report
    queue: Client = client
    dataset: DatasetSource = source

    def submit_unit(unit: NightlyUnit, job_id: str) -> str:
        return queue.submit(dataset.restricted(unit.files), job_id=job_id, unit=unit.unit, **submit)

    starter = _Starter(queue, fs, root_path, poll_seconds)
    for unit in sorted(plan.todo, key=lambda u: u.name):
        entry = by_unit[unit.unit]
        entry.job_id = job_id = nightly_job_id(unit, output)
        try:
            entry.action = starter.start(unit, job_id, submit_unit)
        except InputError as e:
            entry.action, entry.error, entry.input_error = SUBMITTED, str(e), True
            say(f"{unit.name}: {e}")
            continue
        say(f"{unit.name}: {entry.action} job {entry.job_id}")
    _wait(client, report, fs, root_path, {u.unit: u.fingerprint for u in plan.todo}, timeout, poll_seconds,
          say, check)
    return report


class _Starter:
    """Starts one unit's job, or finds it started: the race between runs, settled by the queue."""

    def __init__(self, client: Client, fs: Any, root_path: str, poll_seconds: float):
        self.client, self.fs, self.root_path, self.poll_seconds = client, fs, root_path, poll_seconds

    def start(self, unit: NightlyUnit, job_id: str, submit: Callable[[NightlyUnit, str], str]) -> str:
        """SUBMITTED when this run opened the job, JOINED when another run's job runs (or wrote the
        unit meanwhile); an ended job that did not write the unit is deleted and submitted again."""
        store = self.client.store
        retried = False
        for _ in range(MAX_START_TRIES):
            record = store.get(job_id)
            if record is None:
                try:
                    submit(unit, job_id)
                    return SUBMITTED
                except InputError:
                    raise
                except ValueError:  # "job ... already exists": another run opened it first
                    if store.get(job_id) is None:
                        raise  # a refused submission (output, options): not a race
                    continue
            if not record.terminal or _covers(_manifest(self.fs, self.root_path, unit.unit), unit):
                return JOINED
            if retried:  # the job this run saw start ended unwritten: that is its outcome
                return JOINED
            if self._delete_ended(job_id, record):
                retried = True
                log.info("job %s ended %s without writing unit %s: submitting it again", job_id,
                         record.status.value, unit.name)
                continue
            time.sleep(self.poll_seconds)  # another run is deleting it: look again
        raise RuntimeError(f"could not start or find job {job_id} after {MAX_START_TRIES} tries")

    def _delete_ended(self, job_id: str, seen: JobRecord) -> bool:
        """Delete ``job_id`` if it is still the ended job ``seen``, with its export's rq job; False
        when another run holds the retry lock, or that export is still running. The lock makes
        check-and-delete one step between runs, so a run never deletes the job another run has just
        submitted again."""
        r = self.client.redis
        lock, token = f"{self.client.keys.job(job_id)}:nightly-retry", uuid.uuid4().hex
        if not r.set(lock, token, nx=True, px=RETRY_LOCK_MS):
            return False
        try:
            now = self.client.store.get(job_id)
            same = now is not None and now.status == seen.status and now.created_at == seen.created_at
            if same and now is not None and now.terminal:  # its kept table goes with it
                # and its export's rq job: left, it would pass for the new job's export (a duplicate)
                if not forget_export(self.client.settings.connect_rq(r), self.client.settings.prefix, job_id):
                    return False
                self.client.store.delete(job_id, files_root=self.client.settings.files_root())
            return True
        finally:
            if r.get(lock) == token.encode():
                r.delete(lock)


def _manifest(fs: Any, root_path: str, unit: str) -> Manifest | None:
    """The unit's manifest under the output root, None when absent or unreadable."""
    try:
        with fs.open_input_stream(manifest_path(root_path, unit)) as f:
            return Manifest.from_json(f.read().decode())
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _covers(manifest: Manifest | None, unit: NightlyUnit) -> bool:
    return manifest is not None and manifest.unit == unit.unit and manifest.fingerprint == unit.fingerprint


def _wait(client: Client, report: NightlyReport, fs: Any, root_path: str, fingerprints: dict[str, str],
          timeout: float | None, poll_seconds: float, say: Callable[[str], None],
          check: Callable[[], None] | None) -> None:
    """Poll the units' jobs until each has ended (or ``timeout``); fill in their reports."""
    pending = {u.job_id: u for u in report.units if u.job_id is not None and not u.input_error}
    deadline = None if timeout is None else time.monotonic() + timeout
    while pending:
        ids = list(pending)
        for job_id, record in zip(ids, client.store.get_many(ids), strict=True):
            entry = pending[job_id]
            if record is None:  # deleted under us (another run retrying it, or an operator)
                entry.error = f"job {job_id} no longer exists"
                entry.status = JobStatus.FAILED.value
                del pending[job_id]
                continue
            _note(entry, record)
            if record.terminal:
                del pending[job_id]
                _finish(entry, record, fs, root_path, fingerprints[entry.unit])
                say(f"{entry.name}: job {job_id} {entry.status}"
                    + (f": {entry.error}" if entry.error else ""))
        if check is not None:
            check()
        if not pending:
            return
        if deadline is not None and time.monotonic() >= deadline:
            report.timed_out = True
            return
        time.sleep(poll_seconds)


def _note(entry: UnitReport, record: JobRecord) -> None:
    entry.status = record.status.value
    entry.rows = record.total
    entry.failed_rows = record.failed


def _finish(entry: UnitReport, record: JobRecord, fs: Any, root_path: str, expected: str) -> None:
    """An ended job: written when it completed and the unit's manifest has its fingerprint."""
    if record.status != JobStatus.COMPLETED:
        errors = [e for e in record.errors if not e.startswith("warning:")]
        entry.error = errors[-1] if errors else f"job {record.id} ended {record.status.value}"
        return
    manifest = _manifest(fs, root_path, entry.unit)
    if manifest is None or manifest.fingerprint != expected:
        state = "missing" if manifest is None else "stale"
        entry.error = f"job {record.id} completed but the unit's manifest is {state}"
        return
    entry.manifest = location_of(fs, manifest_path(root_path, entry.unit))
