"""Nightly pipelines end to end (issue 31): a Hive-partitioned dataset in a real S3-compatible server
(moto's server mode), ``batchinfer nightly`` on the real daemons (scheduler, an echo worker, the
exporter), a partitioned dataset with manifests back in the bucket, read and joined to the input
by DuckDB and polars on the kept keys.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest
from daemons import Stack

DAYS = ("2026-12-01", "2026-12-02", "2026-12-03")
ROWS_PER_DAY = 3334  # 10,002 rows over the three partitions
LANGS = ("en", "fr", "de")
TEMPLATE = "Title: {{ title }}\n{{ body }}"


@pytest.fixture
def lake(s3_server, monkeypatch) -> str:
    """A bucket of its own (the server is the session's) and this process's AWS environment."""
    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)
    bucket = f"lake-{uuid.uuid4().hex[:8]}"
    s3_server.make_bucket(bucket)
    return bucket


def write_day(bucket: str, day: str, first_id: int, rows: int, *, null_title_at: int | None = None) -> None:
    """``events/date=<day>/part-0.parquet``: ids ``first_id`` .. ``first_id + rows - 1``."""
    ids = list(range(first_id, first_id + rows))
    titles = [None if i == null_title_at else f"title {i}" for i in ids]
    table = pa.table({"id": pa.array(ids, pa.int64()), "title": pa.array(titles, pa.string()),
                      "body": [f"body of {i}" for i in ids], "lang": [LANGS[i % 3] for i in ids]})
    fs, _ = pafs.FileSystem.from_uri(f"s3://{bucket}")
    pq.write_table(table, f"{bucket}/events/date={day}/part-0.parquet", filesystem=fs)


@pytest.fixture
def stack(redis_server, tmp_path, s3_server, lake):
    """Scheduler and a fast echo worker on the bucket's queue; the exporter is each test's to start.
    The exporter may write below ``s3://<bucket>/enriched`` (the operator's allowed prefixes)."""
    env = {**s3_server.env(), "BATCHINFER_OUTPUT_URI_PREFIXES": f"s3://{lake}/enriched",
           "BATCHINFER_FILES_DIR": str(tmp_path / "files"), "AWS_MAX_ATTEMPTS": "2"}
    stack = Stack(redis_server.url, tmp_path, env=env)
    stack.start("scheduler", "scheduler")
    stack.worker("w", echo=True, options={"requests_per_step": 512, "max_num_seqs": 512})
    stack.wait_for_workers(1)
    yield stack
    stack.close()


def template_file(stack: Stack, text: str = TEMPLATE) -> str:
    path = stack.tmp / f"t-{uuid.uuid4().hex[:6]}.jinja"
    path.write_text(text)
    return str(path)


def nightly(stack: Stack, bucket: str, *extra: str, partition_by: str = "date") -> tuple[int, dict, str]:
    """``batchinfer nightly --json`` from the input ``events/`` to ``enriched/``: exit code, report,
    stderr and the daemons' logs."""
    done = stack.cli("nightly", "--input", f"s3://{bucket}/events/", "-o", f"s3://{bucket}/enriched/",
                     "--model", "echo", "--keep-columns", "id,lang", "--partition-by", partition_by, "--json",
                     *extra)
    report = json.loads(done.stdout) if done.stdout.strip().startswith("{") else {}
    return done.returncode, report, done.stderr + stack.logs()


def read_json(bucket: str, key: str) -> dict:
    """The JSON object at ``key`` in ``bucket`` (a manifest), read through pyarrow's S3 filesystem."""
    return json.loads(pafs.FileSystem.from_uri(f"s3://{bucket}")[0].open_input_stream(f"{bucket}/{key}").read())


def objects(s3_server, bucket: str, prefix: str = "enriched/") -> dict[str, str]:
    """Every object below ``prefix``: key -> ETag (what a reader of the bucket sees, and whether it
    changed); the empty folder markers pyarrow's ``create_dir`` leaves (``key/``) are not files."""
    import boto3

    client = boto3.client("s3", endpoint_url=s3_server.endpoint, region_name="us-east-1",
                          aws_access_key_id="testing", aws_secret_access_key="testing")
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    return {o["Key"]: o["ETag"] for page in pages for o in page.get("Contents", [])
            if not o["Key"].endswith("/")}


def storage_options(s3_server) -> dict[str, str]:
    return {"aws_endpoint_url": s3_server.endpoint, "aws_access_key_id": "testing",
            "aws_secret_access_key": "testing", "aws_region": "us-east-1", "aws_allow_http": "true"}


def duckdb_join(bucket: str) -> tuple[int, int, int, int]:
    """DuckDB over the bucket (an fsspec view of pyarrow's S3 filesystem: no httpfs download):
    (result rows, distinct ids, input rows matched, rows whose date or lang differs from the input's)."""
    import duckdb
    from fsspec.implementations.arrow import ArrowFSWrapper

    class S3(ArrowFSWrapper):
        protocol = "s3"

    con = duckdb.connect()
    con.register_filesystem(S3(pafs.FileSystem.from_uri(f"s3://{bucket}")[0]))
    out = f"read_parquet('s3://{bucket}/enriched/**/*.parquet', hive_partitioning = true)"
    inp = f"read_parquet('s3://{bucket}/events/**/*.parquet', hive_partitioning = true)"
    row = con.sql(f"select count(*), count(distinct o.id), count(i.id), "
                  f"count(*) filter (where o.date::varchar <> i.date::varchar or o.lang <> i.lang) "
                  f"from {out} o left join {inp} i on o.id = i.id").fetchall()[0]
    assert row is not None
    return row


def test_nightly_fills_the_output_then_processes_only_new_partitions(stack, lake, s3_server):
    stack.start("exporter", "exporter")
    for n, day in enumerate(DAYS):
        write_day(lake, day, n * ROWS_PER_DAY, ROWS_PER_DAY)
    tpl = template_file(stack)

    code, report, logs = nightly(stack, lake, "--template", tpl)
    assert code == 0, logs
    assert (report["submitted"], report["skipped"], report["written"]) == (3, 0, True), report
    assert all(u["status"] == "completed" and u["rows"] == ROWS_PER_DAY and u["failed_rows"] == 0
               for u in report["units"]), report
    first = objects(s3_server, lake)
    data = sorted(k for k in first if k.endswith(".parquet"))
    manifests = sorted(k for k in first if k.startswith("enriched/_manifests/"))
    assert [k.split("/")[1] for k in data] == [f"date={d}" for d in DAYS]
    assert len(manifests) == 3 and all(k.endswith(".json") for k in manifests)
    assert set(first) == set(data) | set(manifests)  # no temporary object left visible

    # DuckDB and polars read the output from the bucket and join it back on the kept key
    assert duckdb_join(lake) == (3 * ROWS_PER_DAY, 3 * ROWS_PER_DAY, 3 * ROWS_PER_DAY, 0)
    import polars as pl

    so = storage_options(s3_server)
    out = pl.scan_parquet(f"s3://{lake}/enriched/**/*.parquet", hive_partitioning=True, storage_options=so)
    inp = pl.scan_parquet(f"s3://{lake}/events/**/*.parquet", hive_partitioning=True, storage_options=so)
    joined = out.join(inp, on="id", how="full", suffix="_in").collect()
    assert joined.height == 3 * ROWS_PER_DAY
    assert joined["id"].null_count() == 0 and joined["id_in"].null_count() == 0  # none missing either side
    assert joined["id"].n_unique() == 3 * ROWS_PER_DAY  # none doubled
    assert out.collect_schema()["id"] == pl.Int64  # the kept column keeps its type
    assert (joined["lang"] == joined["lang_in"]).all()
    assert (joined["status"] == "completed").all()
    # the echo engine answers with the prompt's tokens: the echo model has a chat template, so the
    # rendered text went in as the user message ("auto"), and each row's answer holds its own input
    texts = joined.select(pl.col("outputs").list.first().struct.field("text"), "title", "body")
    assert all(f"user: Title: {title}\n{body}\n" in text for text, title, body in texts.iter_rows()), \
        texts.head(3).to_dicts()
    manifest = read_json(lake, manifests[0])
    (output,) = manifest["outputs"]
    assert output["rows"] == ROWS_PER_DAY and output["inputs"][0]["rows"] == ROWS_PER_DAY
    assert output["inputs"][0]["location"].startswith(f"s3://{lake}/events/date=")

    # a second run has nothing to do and touches nothing
    code, report, logs = nightly(stack, lake, "--template", tpl)
    assert code == 0, logs
    assert (report["submitted"], report["skipped"]) == (0, 3), report
    assert objects(s3_server, lake) == first

    # a new partition is processed alone; the others' files stay as they were
    write_day(lake, "2026-12-04", 3 * ROWS_PER_DAY, 500)
    code, report, logs = nightly(stack, lake, "--template", tpl)
    assert code == 0, logs
    assert (report["submitted"], report["skipped"]) == (1, 3), report
    (new,) = [u for u in report["units"] if u["action"] == "submitted"]
    assert new["partition"] == {"date": "2026-12-04"} and new["rows"] == 500
    third = objects(s3_server, lake)
    assert {k: v for k, v in third.items() if k in first} == first
    assert len([k for k in third if k.endswith(".parquet")]) == 4
    assert duckdb_join(lake)[:3] == (3 * ROWS_PER_DAY + 500,) * 3


KILLING_EXPORT = textwrap.dedent("""
    # The exporter's export, killed (os._exit: no clean-up runs, as with SIGKILL) half-way through
    # writing the second file of the unit, after the first one was placed.
    import contextlib, os, sys
    import batchinfer.jobs.partitioned as partitioned
    from batchinfer.jobs.export import export_job

    real, placed = partitioned.atomic_output, []

    class Dying:
        def __init__(self, stream):
            self.stream = stream
        def write(self, chunk):
            self.stream.write(chunk[: len(chunk) // 2])
            os._exit(9)

    @contextlib.contextmanager
    def atomic_output(dest, **kw):
        with real(dest, **kw) as stream:
            yield Dying(stream) if placed else stream
        placed.append(dest.location)

    partitioned.atomic_output = atomic_output
    export_job(sys.argv[1], prefix=sys.argv[2], redis_url=sys.argv[3])
""")


def test_an_exporter_killed_mid_write_leaves_nothing_half_visible_and_a_rerun_completes(
        stack, lake, s3_server, tmp_path):
    write_day(lake, DAYS[0], 0, 900)
    tpl = template_file(stack)
    # no exporter yet: the job gets every row, then waits for its export
    code, report, logs = nightly(stack, lake, "--template", tpl, "--timeout", "3", partition_by="date,lang")
    assert code == 6, logs  # timed out; the job goes on
    (unit,) = report["units"]
    job = unit["job_id"]
    stack.until(lambda: stack.client.status(job).status.value == "finalizing", 120, "all rows published")

    script = tmp_path / "killing_export.py"
    script.write_text(KILLING_EXPORT)
    killed = subprocess.run([sys.executable, "-P", str(script), job, stack.prefix, stack.redis_url],
                            env=stack.env, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert killed.returncode == 9, killed.stderr[-3000:]
    after_kill = objects(s3_server, lake)
    # one file of the unit's three (a lang each), complete; no manifest, no temporary object
    (placed,) = after_kill
    assert placed.startswith(f"enriched/date={DAYS[0]}/lang=") and placed.endswith(".parquet")
    fs = pafs.FileSystem.from_uri(f"s3://{lake}")[0]
    assert pq.read_table(f"{lake}/{placed}", filesystem=fs).num_rows == 300
    assert stack.client.status(job).status.value == "finalizing"  # not completed: the export did not end

    # the exporter runs the queued export again; the nightly run ends written: it joins the job, or,
    # where the export ended before the run planned, finds the unit's manifest (of that same job) up to date
    stack.start("exporter", "exporter")
    code, report, logs = nightly(stack, lake, "--template", tpl, partition_by="date,lang")
    assert code == 0, logs
    (unit,) = report["units"]
    assert unit["written"], report
    if unit["action"] == "skipped":
        assert unit["job_id"] is None and unit["status"] is None, report
    else:
        assert (unit["action"], unit["job_id"], unit["status"]) == ("joined", job, "completed"), report
    assert stack.client.status(job).status.value == "completed"
    final = objects(s3_server, lake)
    (manifest_key,) = [k for k in final if "_manifests/" in k]
    manifest = read_json(lake, manifest_key)
    assert manifest["job_id"] == job, manifest
    data = sorted(k for k in final if k.endswith(".parquet"))
    assert [k.split("/")[2] for k in data] == [f"lang={x}" for x in sorted(LANGS)]
    assert len([k for k in final if "_manifests/" in k]) == 1 and len(final) == 4
    assert duckdb_join(lake) == (900, 900, 900, 0)  # every row once: the placed file was replaced


def test_bad_rows_are_error_rows_and_bad_inputs_clear_errors_with_nothing_written(stack, lake, s3_server):
    stack.start("exporter", "exporter")
    write_day(lake, DAYS[0], 0, 50, null_title_at=7)
    body = template_file(stack, '{"prompt": {{ title | tojson }}, "max_tokens": 2, "custom_id": "r{{ id }}"}')
    code, report, logs = nightly(stack, lake, "--body-template", body)
    assert code == 0, logs
    (unit,) = report["units"]
    assert (unit["rows"], unit["failed_rows"]) == (50, 1), report
    import polars as pl

    rows = pl.read_parquet(f"s3://{lake}/enriched/**/*.parquet", hive_partitioning=True,
                           storage_options=storage_options(s3_server)).sort("id")
    bad = rows.filter(pl.col("status") == "failed")
    assert bad["id"].to_list() == [7] and bad["line"].to_list() == [8]  # row 8 of its file
    message = bad["error_message"][0]
    assert f"s3://{lake}/events/date={DAYS[0]}/part-0.parquet row 8" in message and "title" in message
    assert rows.filter(pl.col("status") == "completed")["custom_id"].to_list()[:2] == ["r0", "r1"]
    before = objects(s3_server, lake)

    # a partition filter that matches nothing, a bucket that does not exist, a template file that
    # does not compile: each exits with its code and a sentence naming the problem; nothing written
    code, _, logs = nightly(stack, lake, "--body-template", body, "--partition", "date=2030-01-01")
    assert code == 7 and "matches no" in logs, logs
    missing = stack.cli("nightly", "--input", f"s3://{lake}-missing/events/", "-o", f"s3://{lake}/enriched/",
                        "--model", "echo", "--template", template_file(stack), "--partition-by", "date")
    assert missing.returncode == 7 and "bucket" in missing.stderr.lower(), missing.stderr
    broken = stack.cli("nightly", "--input", f"s3://{lake}/events/", "-o", f"s3://{lake}/enriched/",
                       "--model", "echo", "--template", template_file(stack, "{{ title "),
                       "--partition-by", "date")
    assert broken.returncode == 2 and "line 1" in broken.stderr, broken.stderr
    outside = stack.cli("nightly", "--input", f"s3://{lake}/events/", "-o", f"s3://{lake}/elsewhere/",
                        "--model", "echo", "--template", template_file(stack), "--partition-by", "date")
    assert outside.returncode == 2 and "elsewhere" in outside.stderr, outside.stderr
    assert objects(s3_server, lake) == before
    assert objects(s3_server, lake, "elsewhere/") == {}
    assert not any(Path(stack.tmp / "files" / "kept").glob(".*"))  # no temporary kept table left
