"""Exports of a job's results stream: schema, order, formats, atomic writes, rq retries, nightly."""

from __future__ import annotations

import datetime as dt
import json
import os
import random
from pathlib import Path

import pyarrow as pa
import pyarrow.dataset as pads
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchinfer.config import Settings
from batchinfer.jobs import nightly
from batchinfer.jobs.export import RESULT_SCHEMA, IdxSorter, enqueue_export, export_job
from batchinfer.jobs.output import resolve, write_rows
from batchinfer.keys import DIRECT, Keys
from batchinfer.protocol.rows import ResultRow
from batchinfer.store.jobstore import JobStore
from batchinfer.store.publish import Publisher

PREFIX = "{t}"


def _row(job_id: str, idx: int, status: str = "completed") -> ResultRow:
    if status != "completed":
        return ResultRow.error("engine_error" if status == "failed" else status, f"request {idx} {status}",
                               status=status, job_id=job_id, idx=idx, custom_id=f"c{idx}", model="m")
    tokens = [idx % 7 + 1, 2, 3]
    return ResultRow(job_id=job_id, request_id=f"{job_id}:{idx}", status="completed", idx=idx,
                     custom_id=f"c{idx}", model="m", finish_reason="length", output_text=f"text {idx}",
                     output_token_ids=tokens,
                     outputs=[{"index": 0, "text": f"text {idx}", "token_ids": tokens,
                               "finish_reason": "length"}],
                     prompt_tokens=5, completion_tokens=3, cached_tokens=0, line=idx + 1,
                     created_at=1_700_000_000_000, started_at=1_700_000_001_000,
                     finished_at=1_700_000_002_000,
                     worker="w1", sampling_params={"max_tokens": 3, "temperature": 0.0},
                     metadata={"k": str(idx)})


def _job(r, n: int, *, failed=(), output=None, fmt="parquet", job_id="job1") -> str:
    """A job of ``n`` requests whose rows were published in a shuffled order; it ends finalizing."""
    keys = Keys(PREFIX)
    JobStore(r, keys).create(job_id, model="m", output=output, output_format=fmt)
    pub = Publisher(r, keys)
    order = list(range(n))
    random.Random(0).shuffle(order)
    for i in order:
        pub.publish(_row(job_id, i, "failed" if i in failed else "completed"))
    pub.finish_submission(job_id, n)
    return job_id


def _record(r, job_id: str) -> dict[str, str]:
    return {k.decode(): v.decode() for k, v in r.hgetall(Keys(PREFIX).job(job_id)).items()}


def test_parquet_export_is_typed_ordered_and_settles_the_job(redis_server, tmp_path):
    r = redis_server.client()
    job = _job(r, 50, failed={3, 17})
    out = tmp_path / "out" / "res.parquet"
    location = export_job(job, prefix=PREFIX, output=str(out), redis_url=redis_server.url)
    assert location == str(out)
    table = pq.read_table(out)
    assert table.schema.equals(RESULT_SCHEMA)
    assert table.schema.field("output_token_ids").type == pa.list_(pa.int32())
    assert table.schema.field("finished_at").type == pa.timestamp("ms", tz="UTC")
    assert table.column("idx").to_pylist() == list(range(50))
    rows = table.to_pylist()
    assert rows[0]["output_token_ids"] == [1, 2, 3]
    assert rows[0]["finished_at"] == dt.datetime(2023, 11, 14, 22, 13, 22, tzinfo=dt.timezone.utc)
    assert json.loads(rows[0]["sampling_params"]) == {"max_tokens": 3, "temperature": 0.0}
    assert json.loads(rows[5]["metadata"]) == {"k": "5"}
    assert rows[3]["status"] == "failed" and rows[3]["error_code"] == "engine_error"
    assert rows[3]["output_token_ids"] is None
    rec = _record(r, job)
    assert rec["status"] == "completed" and rec["output"] == str(out) and "completed_at" in rec
    ttl = Settings.from_env(prefix=PREFIX).results_ttl_seconds  # the stream is kept for the TTL, then dropped
    assert ttl - 60 < r.ttl(Keys(PREFIX).results(job)) <= ttl
    assert [p.name for p in out.parent.iterdir()] == ["res.parquet"]  # no temporary left over


def test_jsonl_and_openai_formats(redis_server, tmp_path):
    r = redis_server.client()
    job = _job(r, 4, failed={2})
    jsonl = tmp_path / "r.jsonl"
    export_job(job, prefix=PREFIX, output=str(jsonl), fmt="jsonl", redis_url=redis_server.url)
    lines = [json.loads(x) for x in jsonl.read_text().splitlines()]
    assert [x["idx"] for x in lines] == [0, 1, 2, 3]
    assert lines[1]["output_token_ids"] == [2, 2, 3] and lines[1]["sampling_params"]["max_tokens"] == 3

    openai = tmp_path / "r.openai.jsonl"
    export_job(job, prefix=PREFIX, output=str(openai), fmt="openai", redis_url=redis_server.url)
    out = [json.loads(x) for x in openai.read_text().splitlines()]
    assert [o["custom_id"] for o in out] == ["c0", "c1", "c2", "c3"]
    ok = out[0]
    assert ok["error"] is None and ok["response"]["status_code"] == 200
    body = ok["response"]["body"]
    assert body["object"] == "text_completion" and body["choices"][0]["text"] == "text 0"
    usage = body["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]) == (5, 3, 8)
    assert usage["prompt_tokens_details"]["cached_tokens"] == 0
    assert out[2]["response"] is None and out[2]["error"]["code"] == "engine_error"


def test_chat_rows_become_chat_completions(tmp_path):
    row = _row("j", 0).to_dict() | {"url": "/v1/chat/completions"}
    path = write_rows([row], str(tmp_path / "o.jsonl"), "openai")
    body = json.loads(Path(path).read_text())["response"]["body"]
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "text 0", "refusal": None,
                                             "annotations": []}


def test_cancelled_and_expired_jobs_keep_their_outcome(redis_server, tmp_path):
    r = redis_server.client()
    keys = Keys(PREFIX)
    store = JobStore(r, keys)
    store.create("jc", model="m")
    store.cancel("jc")
    pub = Publisher(r, keys)
    pub.publish(_row("jc", 0))
    pub.publish(_row("jc", 1, "cancelled"))
    pub.finish_submission("jc", 2)
    export_job("jc", prefix=PREFIX, output=str(tmp_path / "c.parquet"), redis_url=redis_server.url)
    assert _record(r, "jc")["status"] == "cancelled"
    assert not r.sismember(keys.cancelled, "jc")
    assert pq.read_table(tmp_path / "c.parquet").column("status").to_pylist() == ["completed", "cancelled"]

    store.create("je", model="m")
    pub.publish(_row("je", 0, "expired"))
    store.set_status("je", "expired")
    pub.finish_submission("je", 1)
    export_job("je", prefix=PREFIX, output=str(tmp_path / "e.parquet"), redis_url=redis_server.url)
    assert _record(r, "je")["status"] == "expired" and _record(r, "je")["output"].endswith("e.parquet")


def test_unfinished_job_is_not_exported(redis_server, tmp_path):
    r = redis_server.client()
    keys = Keys(PREFIX)
    JobStore(r, keys).create("ju", model="m")
    Publisher(r, keys).publish(_row("ju", 0))
    Publisher(r, keys).finish_submission("ju", 2)  # one row of two
    with pytest.raises(RuntimeError, match="in_progress"):
        export_job("ju", prefix=PREFIX, output=str(tmp_path / "u.parquet"), redis_url=redis_server.url)
    assert not (tmp_path / "u.parquet").exists()
    assert "in_progress" in _record(r, "ju")["export_error"]


def test_unwritable_destination_is_recorded_and_the_job_not_completed(redis_server, tmp_path):
    r = redis_server.client()
    job = _job(r, 3)
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    with pytest.raises(OSError):
        export_job(job, prefix=PREFIX, output=str(blocker / "out.parquet"), redis_url=redis_server.url)
    rec = _record(r, job)
    assert rec["status"] == "failed"  # outside rq this was the last attempt
    assert "export failed" in rec["export_error"] and json.loads(rec["errors"])[-1] == rec["export_error"]
    assert "output" not in rec


def test_failed_rename_leaves_no_partial_file(redis_server, tmp_path):
    r = redis_server.client()
    job = _job(r, 20)
    target = tmp_path / "taken"
    (target / "inside").mkdir(parents=True)  # a non-empty folder where the file should go
    with pytest.raises(OSError):
        export_job(job, prefix=PREFIX, output=str(target), redis_url=redis_server.url)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]  # the temporary is gone
    assert [p.name for p in target.iterdir()] == ["inside"]


def test_relative_outputs_stay_below_results_root(tmp_path):
    root = tmp_path / "results"
    assert resolve("a/b.parquet", str(root)).path == str(root / "a" / "b.parquet")
    with pytest.raises(ValueError, match="leaves the results folder"):
        resolve("../escape.parquet", str(root))
    assert resolve("file://" + str(tmp_path / "x.parquet")).path == str(tmp_path / "x.parquet")
    with pytest.raises(ValueError, match="format must be one of"):
        write_rows([], str(tmp_path / "x"), "csv")


def test_default_output_goes_below_results_root(redis_server, tmp_path, monkeypatch):
    monkeypatch.setenv("BATCHINFER_RESULTS_ROOT", str(tmp_path / "root"))
    r = redis_server.client()
    job = _job(r, 2)
    location = export_job(job, prefix=PREFIX, redis_url=redis_server.url)
    assert location == str(tmp_path / "root" / "job1.parquet") and pq.read_table(location).num_rows == 2


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 60), max_size=200), st.integers(1, 1500), st.integers(2, 5))
def test_idx_sorter_orders_and_dedupes_with_spills(tmp_path_factory, idxs, run_bytes, max_runs):
    # run_bytes 1..1500: runs of 1 to ~11 rows; max_runs 2..5: merges of several levels
    spill = str(tmp_path_factory.mktemp("spill"))
    sorter = IdxSorter(spill, run_bytes=run_bytes, max_runs=max_runs)
    for n, i in enumerate(idxs):
        sorter.add(i, f"{i}:{n}".encode())
    out = [raw.decode() for raw in sorter]
    assert os.listdir(spill) == []  # every run file deleted
    first = {}
    for n, i in enumerate(idxs):
        first.setdefault(i, f"{i}:{n}")
    assert out == [first[i] for i in sorted(first)]
    assert sorter.duplicates == len(idxs) - len(first)


def test_rq_export_runs_and_retries_through_the_exporter_worker(redis_server, tmp_path, monkeypatch):
    from rq import Queue
    from rq.registry import ScheduledJobRegistry
    from rq.serializers import JSONSerializer

    from batchinfer.jobs.exporter import build_worker

    monkeypatch.setenv("BATCHINFER_OUTPUT_URI_PREFIXES", tmp_path.as_uri())  # the file:// outputs
    r = redis_server.client()
    s = Settings(prefix=PREFIX)
    ok = _job(r, 5, output=(tmp_path / "ok.parquet").as_uri(), job_id="jok")
    bad = _job(r, 2, output=(tmp_path / "file" / "x.parquet").as_uri(), job_id="jbad")
    (tmp_path / "file").write_text("not a folder")
    enqueue_export(r, s, ok)
    enqueue_export(r, s, bad)
    build_worker(r).work(burst=True)
    assert _record(r, ok)["status"] == "completed" and pq.read_table(tmp_path / "ok.parquet").num_rows == 5
    rec = _record(r, bad)
    assert rec["status"] == "finalizing" and "export failed" in rec["export_error"]  # retries are left
    queue = Queue("batchinfer", connection=r, serializer=JSONSerializer)
    assert len(ScheduledJobRegistry(queue=queue).get_job_ids()) == 1  # the retry is booked
    enqueue_export(r, s, bad)  # asked again while the retry is booked: rq's retry stays the only run
    assert queue.count == 0 and len(ScheduledJobRegistry(queue=queue).get_job_ids()) == 1


def test_an_export_is_queued_and_run_once_however_often_it_is_enqueued(redis_server, tmp_path, monkeypatch):
    from rq import Queue
    from rq.job import Job, JobStatus
    from rq.serializers import JSONSerializer

    from batchinfer.jobs.exporter import build_worker

    monkeypatch.setenv("BATCHINFER_OUTPUT_URI_PREFIXES", tmp_path.as_uri())  # the file:// outputs
    r = redis_server.client()
    s = Settings(prefix=PREFIX)
    job = _job(r, 3, output=(tmp_path / "once.parquet").as_uri(), job_id="jonce")
    queue = Queue("batchinfer", connection=r, serializer=JSONSerializer)
    rq_id = enqueue_export(r, s, job)
    assert enqueue_export(r, s, job) == rq_id
    assert queue.get_job_ids() == [rq_id]  # one queue entry, not one per call
    build_worker(r).work(burst=True)
    rq_job = Job.fetch(rq_id, connection=r, serializer=JSONSerializer)
    assert rq_job.get_status() == JobStatus.FINISHED and len(rq_job.results()) == 1  # one export run
    assert _record(r, job)["status"] == "completed"
    enqueue_export(r, s, job)  # after the export finished: nothing more to run
    assert queue.count == 0 and rq_job.get_status() == JobStatus.FINISHED
    # Once rq has dropped its job (result TTL), the scheduler's safety net can enqueue the export anew.
    rq_job.delete()
    assert enqueue_export(r, s, job) == rq_id and queue.get_job_ids() == [rq_id]


def _direct_row(n: int) -> str:
    return json.dumps({"job_id": None, "request_id": f"d{n}", "status": "completed", "output_text": str(n),
                       "output_token_ids": [n], "finished_at": 0})


def test_nightly_export_writes_a_hive_dataset_once(redis_server, tmp_path, monkeypatch):
    monkeypatch.setenv("BATCHINFER_RESULTS_ROOT", str(tmp_path))
    monkeypatch.setenv("BATCHINFER_RESULTS_TTL_SECONDS", str(24 * 3600))
    r = redis_server.client()
    stream = Keys(PREFIX).results(DIRECT)
    day1 = int(dt.datetime(2024, 5, 1, 12, tzinfo=dt.timezone.utc).timestamp() * 1000)
    day2 = day1 + nightly.DAY_MS
    for n, ms in enumerate([day1, day1 + 1, day2, day2 + 5, day2 + nightly.DAY_MS]):
        r.xadd(stream, {"row": _direct_row(n)}, id=f"{ms}-0")
    def run(until):
        return nightly.export_direct(prefix=PREFIX, until_ms=until, redis_url=redis_server.url)

    first = run(day2 + nightly.DAY_MS // 2)
    assert [os.path.basename(os.path.dirname(f)) for f in first] == ["date=2024-05-01", "date=2024-05-02"]
    assert run(day2 + nightly.DAY_MS // 2) == []  # the dataset is its own watermark
    run(day2 + 2 * nightly.DAY_MS)
    table = nightly.read_direct(prefix=PREFIX)  # our reader: `date` is a DATE, as DuckDB / polars see it
    assert sorted(table.column("request_id").to_pylist()) == ["d0", "d1", "d2", "d3", "d4"]
    assert table.schema.field("date").type == pa.date32()
    days = [dt.date(2024, 5, 1), dt.date(2024, 5, 2), dt.date(2024, 5, 3)]
    assert sorted(set(table.column("date").to_pylist())) == days
    assert table.schema.field("outputs").type == RESULT_SCHEMA.field("outputs").type  # the job files' types
    late = nightly.read_direct(prefix=PREFIX, filter=pads.field("date") >= dt.date(2024, 5, 2),
                               columns=["request_id", "date"])
    assert sorted(late.column("request_id").to_pylist()) == ["d2", "d3", "d4"]
    plain = pads.dataset(str(tmp_path / "direct"), format="parquet", partitioning=nightly.PARTITIONING)
    assert plain.schema.field("date").type == pa.date32()  # pyarrow itself, given the partitioning
    assert nightly.read_direct(str(tmp_path / "none")).num_rows == 0
    assert r.xlen(stream) == 1  # rows older than the TTL before the last cutoff are trimmed


def test_nightly_schedule_is_idempotent_and_runs_under_the_rq_scheduler(redis_server, tmp_path, monkeypatch):
    from rq import Queue
    from rq.registry import ScheduledJobRegistry
    from rq.serializers import JSONSerializer

    from batchinfer.jobs.exporter import build_worker

    monkeypatch.setenv("BATCHINFER_RESULTS_ROOT", str(tmp_path))
    r = redis_server.client()
    s = Settings(prefix=PREFIX)
    queue = Queue("batchinfer", connection=r, serializer=JSONSerializer)
    registry = ScheduledJobRegistry(queue=queue)
    first = nightly.schedule_nightly(r, s)
    assert nightly.schedule_nightly(r, s) == first and registry.get_job_ids() == [first]
    when = registry.get_scheduled_time(first)
    assert (when.hour, when.minute) == (0, 10) and when > dt.datetime.now(dt.timezone.utc)

    yesterday = int((dt.datetime.now(dt.timezone.utc) - dt.timedelta(days=1)).timestamp() * 1000)
    r.xadd(Keys(PREFIX).results(DIRECT), {"row": _direct_row(7)}, id=f"{yesterday}-0")
    due = nightly.schedule_nightly(r, s, when=dt.datetime.now(dt.timezone.utc) - dt.timedelta(minutes=1))
    build_worker(r).work(burst=True, with_scheduler=True)  # the scheduler enqueues what is due, then runs it
    assert due not in registry.get_job_ids() and first in registry.get_job_ids()
    table = pads.dataset(str(tmp_path / "direct"), format="parquet", partitioning="hive").to_table()
    assert table.column("request_id").to_pylist() == ["d7"]


def test_exporter_main_books_the_nightly_run_and_exports_in_burst_mode(redis_server, tmp_path, monkeypatch):
    from rq import Queue
    from rq.registry import ScheduledJobRegistry
    from rq.serializers import JSONSerializer

    from batchinfer.jobs import exporter

    monkeypatch.setenv("BATCHINFER_OUTPUT_URI_PREFIXES", tmp_path.as_uri())  # the file:// outputs
    r = redis_server.client()
    s = Settings(redis_url=redis_server.url, prefix=PREFIX)
    job = _job(r, 3, output=(tmp_path / "burst.parquet").as_uri(), job_id="jburst")
    enqueue_export(r, s, job)
    assert exporter.main(s, name="exporter-test", burst=True) == 0
    assert _record(r, job)["status"] == "completed"
    assert pq.read_table(tmp_path / "burst.parquet").num_rows == 3
    queue = Queue("batchinfer", connection=r, serializer=JSONSerializer)
    assert [j for j in ScheduledJobRegistry(queue=queue).get_job_ids() if "nightly" in j]
