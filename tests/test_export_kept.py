"""Exports of dataset jobs: kept input columns joined to the rows by idx (Parquet types, JSONL keys,
OpenAI / Anthropic metadata), and partitioned outputs with their manifest, on a real Redis."""

from __future__ import annotations

import datetime as dt
import decimal
import json
import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchinfer.client.client import Client
from batchinfer.config import Settings
from batchinfer.datasets.kept import KeptWriter, kept_location
from batchinfer.datasets.manifest import Manifest
from batchinfer.jobs.export import RESULT_SCHEMA, export_job
from batchinfer.keys import Keys
from batchinfer.protocol.entries import JobOp, RequestError
from batchinfer.protocol.rows import ResultRow
from batchinfer.store.jobcontrol import check_open, open_job
from batchinfer.store.jobstore import JobStatus, JobStore
from batchinfer.store.publish import Publisher

PREFIX = "{k}"
KEPT = pa.schema([pa.field("id", pa.int64()), pa.field("day", pa.date32()),
                  pa.field("price", pa.decimal128(10, 2)), pa.field("tags", pa.list_(pa.string()))])
DAYS = [dt.date(2026, 12, 1), dt.date(2026, 12, 2), dt.date(2026, 12, 3)]
FILES = [{"location": "/lake/events/a.parquet", "relative": "a.parquet", "size": 100},
         {"location": "/lake/events/b.parquet", "relative": "b.parquet", "size": 200}]


@pytest.fixture
def settings(tmp_path, monkeypatch) -> Settings:
    monkeypatch.setenv("BATCHINFER_RESULTS_ROOT", str(tmp_path))
    return Settings.from_env(prefix=PREFIX)


def _kept_row(i: int, days=DAYS) -> dict:
    return {"id": 1000 + i, "day": days[i % len(days)], "price": decimal.Decimal(i) / 100,
            "tags": None if i % 4 == 0 else [f"t{i}"]}


def _job(r, settings: Settings, job_id: str, n: int, *, fmt="parquet", output=None, partition_by=None,
         unit=None, days=DAYS, kept_rows: int | None = None) -> str:
    """A dataset job of ``n`` requests: opened as the client opens it, its kept table written (the first
    half of the rows from file 0, the rest from file 1), its rows published shuffled; it ends finalizing."""
    open_job(r, Keys(PREFIX), JobOp.open(job_id, model="m", output=output, output_format=fmt, kept=True,
                                         partition_by=partition_by, unit=unit), settings)
    writer = KeptWriter(kept_location(settings.files_root(), job_id), KEPT,
                        {"input": "/lake/events", "unit": unit or job_id, "files": FILES,
                         "keep_columns": KEPT.names, "partition_by": partition_by or []})
    rows = [_kept_row(i, days) for i in range(n if kept_rows is None else kept_rows)]
    half = len(rows) // 2
    for file_index, part in ((0, rows[:half]), (1, rows[half:])):
        writer.add(pa.RecordBatch.from_pylist(part, schema=KEPT), file_index,
                   pa.array(range(1, len(part) + 1), pa.int64()))
    writer.close()
    pub = Publisher(r, Keys(PREFIX))
    order = list(range(n))
    random.Random(1).shuffle(order)
    for i in order:
        pub.publish(ResultRow(job_id=job_id, request_id=f"{job_id}:{i}", status="completed", idx=i,
                              custom_id=f"c{i}", model="m", finish_reason="stop", output_text=f"answer {i}",
                              output_token_ids=[1, 2], prompt_tokens=4, completion_tokens=2, cached_tokens=0,
                              line=i + 1, url="/v1/chat/completions"))
    pub.finish_submission(job_id, n)
    return job_id


def test_parquet_gets_the_kept_columns_with_their_types(redis_server, settings, tmp_path):
    r = redis_server.client()
    job = _job(r, settings, "job-pq", 10, output="pq/out.parquet")
    location = export_job(job, prefix=PREFIX, redis_url=redis_server.url)
    table = pq.read_table(location)
    assert table.schema.names == [*RESULT_SCHEMA.names, *KEPT.names]  # kept columns after the results
    assert [table.schema.field(n).type for n in KEPT.names] == list(KEPT.types)
    assert table.column("idx").to_pylist() == list(range(10))
    assert table.slice(0, 10).select(KEPT.names).to_pylist() == [_kept_row(i) for i in range(10)]
    assert JobStore(r, Keys(PREFIX)).get(job).status == JobStatus.COMPLETED


def test_jsonl_openai_and_anthropic_lines_carry_the_kept_values(redis_server, settings, tmp_path):
    r = redis_server.client()
    job = _job(r, settings, "job-lines", 6, fmt="jsonl", output="lines/out.jsonl")
    lines = [json.loads(x) for x in Path(export_job(job, prefix=PREFIX, redis_url=redis_server.url))
             .read_text().splitlines()]
    assert [x["idx"] for x in lines] == list(range(6))
    assert {k: lines[5][k] for k in KEPT.names} == {"id": 1005, "day": "2026-12-03", "price": "0.05",
                                                    "tags": ["t5"]}
    for fmt, check in (("openai", lambda o: o["response"]["body"]["object"] == "chat.completion"),
                       ("anthropic", lambda o: o["result"]["type"] == "succeeded")):
        out = tmp_path / f"x.{fmt}.jsonl"
        export_job(job, prefix=PREFIX, output=str(out), fmt=fmt, redis_url=redis_server.url)
        got = [json.loads(x) for x in out.read_text().splitlines()]
        assert all(check(o) for o in got)
        assert got[2]["custom_id"] == "c2"
        assert got[2]["metadata"] == {"id": 1002, "day": "2026-12-03", "price": "0.02", "tags": ["t2"]}


def test_a_kept_table_that_does_not_match_fails_the_export_clearly(redis_server, settings):
    r = redis_server.client()
    job = _job(r, settings, "job-short", 5, output="short.parquet", kept_rows=4)
    with pytest.raises(ValueError, match="has 4 rows, but the job has 5 requests"):
        export_job(job, prefix=PREFIX, redis_url=redis_server.url)
    record = JobStore(r, Keys(PREFIX)).get(job)
    assert record.status == JobStatus.FAILED and "4 rows" in record.errors[-1]


def test_partitioned_export_writes_the_dataset_and_the_manifest(redis_server, settings, tmp_path):
    r = redis_server.client()
    store = JobStore(r, Keys(PREFIX))
    job = _job(r, settings, "job-part", 12, output="enriched", partition_by=["day"], unit="unit1")
    record = store.get(job)
    assert record.kept and record.partition_by == ["day"] and record.unit == "unit1"
    assert record.manifest is None
    root = export_job(job, prefix=PREFIX, redis_url=redis_server.url)
    assert root == str(tmp_path / "enriched")
    files = sorted(str(p.relative_to(root)) for p in Path(root).rglob("*") if p.is_file())
    assert files == ["_manifests/unit1.json", *[f"day={d}/part-unit1.parquet" for d in DAYS]]
    record = store.get(job)
    assert record.status == JobStatus.COMPLETED and record.output == root
    assert record.manifest == f"{root}/_manifests/unit1.json"
    manifest = Manifest.from_json(Path(record.manifest).read_text())
    assert (manifest.unit, manifest.job_id, manifest.model) == ("unit1", job, "m")
    assert manifest.input == "/lake/events"
    assert manifest.inputs == FILES and sum(o.rows for o in manifest.outputs) == 12
    first = manifest.outputs[0]  # day 1: idx 0, 3 (file 0, rows 1 and 4), 6, 9 (file 1, rows 1 and 4)
    assert first.partition == {"day": "2026-12-01"} and first.rows == 4
    assert [(s.location, s.rows, s.first_row, s.last_row) for s in first.inputs] == [
        ("/lake/events/a.parquet", 2, 1, 4), ("/lake/events/b.parquet", 2, 1, 4)]
    table = pq.read_table(Path(root) / f"day={DAYS[1]}" / "part-unit1.parquet")
    assert "day" not in table.schema.names and table.schema.field("price").type == pa.decimal128(10, 2)
    assert table.column("id").to_pylist() == [1001, 1004, 1007, 1010]

    # once the results stream is gone, the client reads the rows back from the manifest's files
    client = Client(settings=Settings.from_env(prefix=PREFIX), connection=r)
    r.delete(Keys(PREFIX).results(job))
    rows = list(client.result_rows(job))
    assert [row["idx"] for row in rows] == list(range(12)) and rows[4]["id"] == 1004

    # the unit again (a new job: its input lost day 3): its files replaced, day 3's deleted
    again = _job(r, settings, "job-part-2", 4, output="enriched", partition_by=["day"], unit="unit1",
                 days=DAYS[:2])
    export_job(again, prefix=PREFIX, redis_url=redis_server.url)
    files = sorted(str(p.relative_to(root)) for p in Path(root).rglob("*") if p.is_file())
    assert files == ["_manifests/unit1.json", *[f"day={d}/part-unit1.parquet" for d in DAYS[:2]]]
    day1 = pq.read_table(Path(root) / f"day={DAYS[0]}" / "part-unit1.parquet")
    assert day1.column("idx").to_pylist() == [0, 2]
    with pytest.raises(LookupError, match="replaced by job job-part-2"):
        list(client.result_rows(job))


def test_partitioned_export_to_s3(redis_server, settings, s3_server, monkeypatch):
    for k, v in s3_server.env().items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("BATCHINFER_OUTPUT_URI_PREFIXES", "s3://export-kept/enriched")
    s3_server.make_bucket("export-kept")  # a bucket of this test's own: the server serves the session
    r = redis_server.client()
    job = _job(r, Settings.from_env(prefix=PREFIX), "job-s3", 9, fmt="jsonl", output="s3://export-kept/enriched",
               partition_by=["day"], unit="u9")
    assert export_job(job, prefix=PREFIX, redis_url=redis_server.url) == "s3://export-kept/enriched"
    keys = sorted(k for k in s3_server.object_keys("export-kept") if not k.endswith("/"))
    assert keys == ["enriched/_manifests/u9.json", *[f"enriched/day={d}/part-u9.jsonl" for d in DAYS]]
    assert JobStore(r, Keys(PREFIX)).get(job).manifest == "s3://export-kept/enriched/_manifests/u9.json"


def test_open_rules_and_the_kept_table_goes_with_the_job(redis_server, settings, tmp_path):
    for op, why in [(JobOp.open("a", output="x", partition_by=["day"]), "needs kept columns"),
                    (JobOp.open("a", kept=True, partition_by=["day"]), "needs an output"),
                    (JobOp.open("a", kept=True, output="x", output_format="openai", partition_by=["day"]),
                     "parquet or jsonl"),
                    (JobOp.open("a", kept=True, output="x", error_output="e", partition_by=["day"]),
                     "error_output")]:
        with pytest.raises(RequestError, match=why) as e:
            check_open(op, settings)
        assert e.value.field == "partition_by"
    check_open(JobOp.open("a", kept=True, output="x", partition_by=["day"]), settings)  # fine
    r = redis_server.client()
    job = _job(r, settings, "job-del", 3, output="del.parquet")
    kept = Path(kept_location(settings.files_root(), job).removeprefix("file://"))
    assert kept.is_file()
    JobStore(r, Keys(PREFIX)).delete(job, files_root=settings.files_root())
    assert not kept.exists() and JobStore(r, Keys(PREFIX)).get(job) is None
    plain = JobStore(r, Keys(PREFIX)).create("plain", model="m")  # a job without a dataset: no such fields
    assert not plain.kept and plain.partition_by == [] and plain.unit is None
    assert not {b"kept", b"partition_by", b"unit", b"manifest"} & set(r.hgetall(Keys(PREFIX).job("plain")))


def test_the_op_fields_round_trip_and_bad_values_are_refused():
    op = JobOp.open("j", kept=True, partition_by=["date", "lang"], unit="u-1", output="x")
    fields = op.to_fields()
    assert (fields["kept"], fields["partition_by"], fields["unit"]) == ("1", "date,lang", "u-1")
    assert JobOp.from_fields(fields).params == op.params
    base = {"v": "1", "op": "open", "job": "j"}
    assert JobOp.from_fields({**base, "kept": "true"}).params["kept"] is True
    assert JobOp.from_fields({**base, "kept": "0"}).params["kept"] is False
    for name, value, why in [("kept", "yes", "1, 0, true or false"), ("unit", "../u", "invalid"),
                             ("partition_by", "a,,b", "empty column name"), ("partition_by", "a/b", "'/'"),
                             ("partition_by", "_hidden", "starts with"), ("partition_by", "a,a", "twice"),
                             ("partition_by", ",".join("abcdefghi"), "at most 8"),
                             ("partition_by", "x" * 129, "longer than 128"),
                             ("partition_by", "a\tb", "control")]:
        with pytest.raises(RequestError, match=why) as e:
            JobOp.from_fields({**base, name: value})
        assert e.value.field == name and e.value.code == "invalid_request"


def test_results_written_by_the_client_carry_the_kept_columns_too(redis_server, settings, tmp_path):
    r = redis_server.client()
    job = _job(r, settings, "job-client", 6, output="c/out.parquet")
    client = Client(url=redis_server.url, settings=settings)
    written = client.write_results(job, str(tmp_path / "mine.parquet"))  # from the results stream
    table = pq.read_table(written)
    assert table.schema.names == [*RESULT_SCHEMA.names, *KEPT.names]
    assert table.select(KEPT.names).to_pylist() == [_kept_row(i) for i in range(6)]
    lines = [json.loads(x) for x in Path(client.write_results(job, str(tmp_path / "mine.jsonl"), "jsonl"))
             .read_text().splitlines()]
    assert [x["id"] for x in lines] == [1000 + i for i in range(6)]


def test_the_clients_results_table_and_dataframe_carry_the_kept_columns(redis_server, settings):
    r = redis_server.client()
    job = _job(r, settings, "job-table", 5, output="t/out.parquet")
    client = Client(url=redis_server.url, settings=settings)
    table = client.results_table(job)
    assert table.schema.names == [*RESULT_SCHEMA.names, *KEPT.names]
    assert table.select(KEPT.names).to_pylist() == [_kept_row(i) for i in range(5)]
    assert client.results(job)["id"].tolist() == [1000 + i for i in range(5)]


def test_kept_tables_of_jobs_that_no_longer_exist_are_swept(redis_server, settings):
    import datetime as dt

    from batchinfer.jobs.nightly import sweep_kept_tables

    r = redis_server.client()
    live = _job(r, settings, "job-live", 2, output="s/live.parquet")
    gone = _job(r, settings, "job-gone", 2, output="s/gone.parquet")
    r.delete(Keys(PREFIX).job(gone))  # its record ended (a TTL): the table is an orphan
    folder = Path(kept_location(settings.files_root(), "x").removeprefix("file://")).parent
    assert sorted(p.name for p in folder.iterdir()) == ["job-gone.parquet", "job-live.parquet"]
    # within the grace period nothing goes (a job being submitted has its table before its record)
    assert sweep_kept_tables(r, settings) == []
    later = dt.datetime.now(dt.timezone.utc) + dt.timedelta(days=2)
    assert sweep_kept_tables(r, settings, now=later) == [kept_location(settings.files_root(), gone)]
    assert [p.name for p in folder.iterdir()] == [f"{live}.parquet"]
