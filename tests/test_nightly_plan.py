"""Issue 31 §3: which units a nightly run processes (plan_nightly), and how it starts their jobs.

The plan is read against real Hive datasets on disk and manifests written with the exporter's own
``write_manifest``; the start-up (skip, join another run's job, retry an ended one) runs against a
real Redis without daemons, so the jobs it opens simply stay open.
"""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest

from batchinfer.client.client import Client
from batchinfer.client.nightly import (
    JOINED,
    SKIPPED,
    SUBMITTED,
    NightlyUnit,
    nightly_job_id,
    plan_nightly,
    run_nightly,
)
from batchinfer.config import Settings
from batchinfer.datasets.errors import InputError
from batchinfer.datasets.kept import kept_location
from batchinfer.datasets.manifest import Manifest, fingerprint, unit_id, write_manifest
from batchinfer.datasets.source import DatasetSource
from batchinfer.datasets.templates import RequestTemplate
from batchinfer.protocol.entries import valid_job_id
from batchinfer.store.jobcontrol import append_job_error
from batchinfer.store.jobstore import JobStatus

DATES = ("2026-12-01", "2026-12-02", "2026-12-03")


def _write(path: Path, ids: range) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"id": list(ids), "title": [f"t{i}" for i in ids]}), path)


def _hive(root: Path) -> Path:
    """date=<d>/part-0.parquet per date, and a second file in the first partition."""
    for n, date in enumerate(DATES):
        _write(root / f"date={date}" / "part-0.parquet", range(n * 10, n * 10 + 3))
    _write(root / f"date={DATES[0]}" / "part-1.parquet", range(100, 102))
    return root


def _done(output: Path, unit: NightlyUnit, stale: bool = False) -> None:
    """The manifest the exporter writes for ``unit`` (``stale``: of other files than the unit's now)."""
    fs, path = pafs.LocalFileSystem(), str(output)
    files = [{"location": f.location, "relative": f.relative, "size": f.size} for f in unit.files]
    print_ = fingerprint([{**files[0], "size": 1}]) if stale else unit.fingerprint
    job_id = nightly_job_id(unit, str(output))
    write_manifest(fs, path, Manifest(unit=unit.unit, fingerprint=print_, job_id=job_id,
                                      input="in", inputs=files, outputs=[], model="m", written_at=1))


def _by_name(units: list[NightlyUnit]) -> dict[str, NightlyUnit]:
    return {u.name: u for u in units}


def test_one_unit_per_hive_partition_with_all_its_files(tmp_path):
    source = DatasetSource(str(_hive(tmp_path / "in")))
    plan = plan_nightly(source, str(tmp_path / "out"))  # no output yet: everything to do
    assert plan.done == []
    units = _by_name(plan.todo)
    assert sorted(units) == [f"date={d}" for d in DATES]
    first = units[f"date={DATES[0]}"]
    assert [Path(f.relative).name for f in first.files] == ["part-0.parquet", "part-1.parquet"]
    assert first.partition == {"date": DATES[0]}
    assert first.unit == unit_id([source.root, f"date={DATES[0]}"])
    assert first.fingerprint == fingerprint(first.files)
    assert len({u.unit for u in plan.todo}) == 3


def test_units_with_a_matching_manifest_are_done_and_a_stale_one_is_not(tmp_path):
    source, out = DatasetSource(str(_hive(tmp_path / "in"))), tmp_path / "out"
    units = _by_name(plan_nightly(source, str(out)).todo)
    _done(out, units[f"date={DATES[0]}"])
    _done(out, units[f"date={DATES[1]}"], stale=True)
    plan = plan_nightly(source, str(out))
    assert [u.name for u in plan.done] == [f"date={DATES[0]}"]
    assert sorted(u.name for u in plan.todo) == [f"date={DATES[1]}", f"date={DATES[2]}"]


def test_a_changed_partition_is_todo_again_under_the_same_unit_id(tmp_path):
    root, out = _hive(tmp_path / "in"), tmp_path / "out"
    before = _by_name(plan_nightly(DatasetSource(str(root)), str(out)).todo)
    for unit in before.values():
        _done(out, unit)
    assert plan_nightly(DatasetSource(str(root)), str(out)).todo == []
    _write(root / f"date={DATES[2]}" / "part-0.parquet", range(20, 40))  # rewritten: another size
    _write(root / f"date={DATES[1]}" / "part-9.parquet", range(5))  # a file added
    plan = plan_nightly(DatasetSource(str(root)), str(out))
    changed = _by_name(plan.todo)
    assert sorted(changed) == [f"date={DATES[1]}", f"date={DATES[2]}"]
    assert [u.name for u in plan.done] == [f"date={DATES[0]}"]
    for name, unit in changed.items():
        assert unit.unit == before[name].unit
        assert unit.fingerprint != before[name].fingerprint
        assert nightly_job_id(unit, str(out)) != nightly_job_id(before[name], str(out))


def test_a_new_partition_is_the_only_unit_to_do(tmp_path):
    root, out = _hive(tmp_path / "in"), tmp_path / "out"
    for unit in plan_nightly(DatasetSource(str(root)), str(out)).todo:
        _done(out, unit)
    _write(root / "date=2026-12-04" / "part-0.parquet", range(3))
    plan = plan_nightly(DatasetSource(str(root)), str(out))
    assert [u.name for u in plan.todo] == ["date=2026-12-04"]
    assert len(plan.done) == 3


def test_an_unpartitioned_input_has_one_unit_per_file(tmp_path):
    root = tmp_path / "flat"
    _write(root / "a.parquet", range(3))
    _write(root / "b.parquet", range(3, 5))
    source = DatasetSource(str(root))
    units = _by_name(plan_nightly(source, str(tmp_path / "out")).todo)
    assert sorted(units) == ["a.parquet", "b.parquet"]
    assert units["a.parquet"].partition == {}
    assert [f.relative for f in units["b.parquet"].files] == ["b.parquet"]
    assert units["a.parquet"].unit == unit_id([source.root, "a.parquet"])


def test_nested_keys_make_one_unit_per_leaf_partition(tmp_path):
    root = tmp_path / "in"
    for date in DATES[:2]:
        for lang in ("de", "en"):
            _write(root / f"date={date}" / f"lang={lang}" / "part-0.parquet", range(2))
    units = _by_name(plan_nightly(DatasetSource(str(root)), str(tmp_path / "out")).todo)
    assert sorted(units) == [f"date={d}/lang={la}" for d in DATES[:2] for la in ("de", "en")]
    assert units[f"date={DATES[1]}/lang=en"].partition == {"date": DATES[1], "lang": "en"}


@pytest.mark.parametrize("filters", [{"partitions": [f"date={DATES[1]}"]},
                                     {"where": f"date = '{DATES[1]}'"}])
def test_a_filter_restricts_the_units_and_keeps_their_ids(tmp_path, filters):
    root, out = _hive(tmp_path / "in"), str(tmp_path / "out")
    everything = _by_name(plan_nightly(DatasetSource(str(root)), out).todo)
    plan = plan_nightly(DatasetSource(str(root), **filters), out)
    assert [u.name for u in plan.todo] == [f"date={DATES[1]}"]
    assert plan.todo[0].unit == everything[f"date={DATES[1]}"].unit


def test_job_ids_are_valid_and_follow_unit_fingerprint_and_output(tmp_path):
    out = tmp_path / "out"
    unit = plan_nightly(DatasetSource(str(_hive(tmp_path / "in"))), str(out)).todo[0]
    job = nightly_job_id(unit, str(out))
    assert valid_job_id(job) and job.startswith(f"nightly-{unit.unit}-") and len(job) == 33
    # one output, however spelled: one id; another output: another id
    assert {nightly_job_id(unit, o) for o in (f"{out}/", out.as_uri(), f"{out.as_uri()}/")} == {job}
    assert nightly_job_id(unit, str(tmp_path / "other")) != job
    assert nightly_job_id(unit, "s3://lake/a/") == nightly_job_id(unit, "s3://lake/a") != \
        nightly_job_id(unit, "s3://lake/b")
    assert valid_job_id(nightly_job_id(unit, "s3://" + "x" * 500))


# -- starting the units' jobs (a real Redis, no daemons: opened jobs stay in progress) -------------


@pytest.fixture
def queue(redis_server, tmp_path, monkeypatch):
    """A client on a fresh Redis whose results root (and file store) is under tmp_path."""
    monkeypatch.setenv("BATCHINFER_RESULTS_ROOT", str(tmp_path / "results"))
    with Client(settings=Settings.from_env(redis_url=redis_server.url)) as client:
        yield client


def _run(client: Client, root: Path, out: Path, **extra):
    template = RequestTemplate.from_text("Title: {{ title }}", name="t.jinja", prompt_as="prompt")
    return run_nightly(client, str(root), str(out), model="m", template=template, keep_columns=["id"],
                       partition_by=["date"], timeout=0.0, poll_seconds=0.01, **extra)


def test_done_units_are_skipped_and_no_job_is_opened(queue, tmp_path):
    root, out = _hive(tmp_path / "in"), tmp_path / "results" / "out"
    for unit in plan_nightly(DatasetSource(str(root)), str(out)).todo:
        _done(out, unit)
    report = _run(queue, root, out)
    assert [u.action for u in report.units] == [SKIPPED] * 3
    assert report.written and not report.timed_out
    assert all(u.manifest and u.manifest.endswith(f"_manifests/{u.unit}.json") for u in report.units)
    assert queue.jobs() == []


def test_todo_units_are_submitted_once_and_a_second_run_joins_them(queue, tmp_path):
    root, out = _hive(tmp_path / "in"), tmp_path / "results" / "out"
    first = _run(queue, root, out)
    assert [u.action for u in first.units] == [SUBMITTED] * 3
    assert first.timed_out and not first.written  # no daemons: the jobs stay open
    record = queue.status(first.units[0].job_id)
    assert record.unit == first.units[0].unit and record.kept and record.partition_by == ["date"]
    second = _run(queue, root, out)
    assert [u.action for u in second.units] == [JOINED] * 3
    assert [u.job_id for u in second.units] == [u.job_id for u in first.units]
    assert len(queue.jobs()) == 3


def test_an_ended_unwritten_job_is_submitted_again(queue, tmp_path):
    root, out = _hive(tmp_path / "in"), tmp_path / "results" / "out"
    first = _run(queue, root, out)
    failed = first.units[1].job_id
    queue.store.set_status(failed, JobStatus.FAILED)
    append_job_error(queue.redis, queue.keys, failed, "the old attempt")
    second = _run(queue, root, out)
    assert [u.action for u in second.units] == [JOINED, SUBMITTED, JOINED]
    fresh = queue.status(failed)
    assert not fresh.terminal
    assert "the old attempt" not in fresh.errors  # a new record, not the failed one


def test_an_ended_job_is_deleted_with_its_kept_table(queue, tmp_path, monkeypatch):
    """The retry deletes the ended job with its kept table, even when the new submission then fails
    (no table outlives its record)."""
    root, out = _hive(tmp_path / "in"), tmp_path / "results" / "out"
    first = _run(queue, root, out)
    failed = first.units[1].job_id
    tables = {u.job_id: Path(kept_location(queue.settings.files_root(), u.job_id).removeprefix("file://"))
              for u in first.units}
    assert all(path.is_file() for path in tables.values())
    queue.store.set_status(failed, JobStatus.FAILED)

    def refused(*args, **kwargs):
        raise InputError("the partition is unreadable now")

    monkeypatch.setattr(queue, "submit", refused)
    second = _run(queue, root, out)
    assert [u.action for u in second.units] == [JOINED, SUBMITTED, JOINED] and second.units[1].input_error
    assert queue.store.get(failed) is None and not tables[failed].exists()
    assert all(path.is_file() for job, path in tables.items() if job != failed)  # the live jobs' stay


def _answer_and_export(client: Client, job_id: str) -> None:
    """Answer every request of ``job_id`` as a worker would (its export enqueued by the row that makes
    the job final, on the shared rq queue) and run the exporter worker until the queue is empty."""
    from batchinfer.jobs.exporter import build_worker
    from batchinfer.jobs.queueing import enqueue_export, publish_then_export
    from batchinfer.protocol.rows import ResultRow

    total = client.status(job_id).total
    assert total
    rows = [(ResultRow(job_id=job_id, request_id=f"{job_id}:{i}", status="completed", idx=i, custom_id=None,
                       model="m", finish_reason="stop", output_text=f"answer {i}", line=i + 1), None)
            for i in range(total)]
    publish_then_export(client.publisher, rows,
                        lambda job: enqueue_export(client.redis, client.settings, job))
    build_worker(client.redis).work(burst=True)


def test_a_resubmitted_job_is_exported_again(queue, tmp_path):
    """A unit's job exported, its output wiped, is deleted and submitted again under the same id: its
    new export must run (the finished export's rq job, kept for days, must not pass for it)."""
    root, out = _hive(tmp_path / "in"), tmp_path / "results" / "out"
    job = _run(queue, root, out).units[1].job_id
    _answer_and_export(queue, job)
    record = queue.status(job)
    assert record.status is JobStatus.COMPLETED and record.manifest
    manifest = Path(record.manifest.removeprefix("file://"))
    manifest.unlink()  # the output wiped: the unit is to do again
    second = _run(queue, root, out)
    assert second.units[1].action == SUBMITTED and second.units[1].job_id == job
    _answer_and_export(queue, job)
    record = queue.status(job)
    assert record.status is JobStatus.COMPLETED and manifest.is_file()


def test_two_outputs_of_one_input_get_jobs_of_their_own(queue, tmp_path):
    """Two pipelines reading one input into two outputs: each submits its own jobs (joining the
    other's would write the other's output)."""
    root, results = _hive(tmp_path / "in"), tmp_path / "results"
    first = _run(queue, root, results / "a")
    second = _run(queue, root, results / "b")
    assert [u.action for u in second.units] == [SUBMITTED] * 3
    assert not {u.job_id for u in first.units} & {u.job_id for u in second.units}
    assert {queue.status(u.job_id).output for u in second.units} == {str(results / "b")}


def test_forget_export_leaves_a_running_export_alone(queue):
    """The export's rq job is forgotten unless it runs (the exporter would write it back when done)."""
    from rq.job import Job
    from rq.job import JobStatus as RqStatus
    from rq.serializers import JSONSerializer

    from batchinfer.jobs.queueing import enqueue_export, forget_export

    r, prefix = queue.redis, queue.settings.prefix
    assert forget_export(r, prefix, "j1")  # none: nothing to do
    rq_id = enqueue_export(r, queue.settings, "j1")
    job = Job.fetch(rq_id, connection=r, serializer=JSONSerializer)
    job.set_status(RqStatus.STARTED)
    assert not forget_export(r, prefix, "j1") and Job.exists(rq_id, connection=r)
    job.set_status(RqStatus.FINISHED)
    assert forget_export(r, prefix, "j1") and not Job.exists(rq_id, connection=r)
    assert enqueue_export(r, queue.settings, "j1") == rq_id and Job.exists(rq_id, connection=r)  # anew
