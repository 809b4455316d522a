"""The partitioned writer: Hive folders, one atomic file per partition and unit, re-runs that replace,
stale files deleted, on a local folder and on a real S3-compatible server (moto)."""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.dataset as pads
import pyarrow.parquet as pq
import pytest

from batchinfer.datasets.manifest import Manifest, fingerprint, read_manifest, write_manifest
from batchinfer.jobs.formats import KEPT_KEY, RESULT_SCHEMA
from batchinfer.jobs.output import resolve
from batchinfer.jobs.partitioned import SOURCE_KEY, delete_stale, manifest_rows, write_partitioned

KEPT = pa.schema([pa.field("id", pa.int64()), pa.field("date", pa.date32()), pa.field("lang", pa.string())])
DAYS = [dt.date(2026, 12, 1), dt.date(2026, 12, 2), dt.date(2026, 12, 3)]
INPUTS = ["s3://lake/events/a.parquet", "s3://lake/events/b.parquet"]


def _rows(n: int, days=DAYS, fail_at: int | None = None):
    """``n`` result rows in idx order, each with its kept values and input position."""
    for i in range(n):
        if i == fail_at:
            raise RuntimeError("the results stream broke")
        yield {"job_id": "j", "request_id": f"j:{i}", "idx": i, "custom_id": f"c{i}", "status": "completed",
               "output_text": f"text {i}", "prompt_tokens": 3, "completion_tokens": 2,
               KEPT_KEY: {"id": 1000 + i, "date": days[i % len(days)], "lang": "en" if i % 2 else None},
               SOURCE_KEY: (i % 2, i // 2 + 1)}


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def test_one_file_per_partition_with_the_partition_only_in_the_path(tmp_path):
    root = resolve(str(tmp_path / "out"))
    outputs = write_partitioned(_rows(30), root, "parquet", partition_by=["date"], kept_schema=KEPT,
                                unit="u1", inputs=INPUTS)
    assert _files(tmp_path / "out") == [f"date={d}/part-u1.parquet" for d in DAYS]
    assert [o.path for o in outputs] == [f"date={d}/part-u1.parquet" for d in DAYS]
    assert [o.partition for o in outputs] == [{"date": str(d)} for d in DAYS]
    assert [o.rows for o in outputs] == [10, 10, 10]
    # rows 0, 3, 6, ... (day 1): even idx from file a (rows 1, 4, 7, ...), odd from file b
    spans = {s.location: s for s in outputs[0].inputs}
    assert spans[INPUTS[0]].rows == 5 and (spans[INPUTS[0]].first_row, spans[INPUTS[0]].last_row) == (1, 13)
    assert spans[INPUTS[1]].rows == 5 and (spans[INPUTS[1]].first_row, spans[INPUTS[1]].last_row) == (2, 14)
    table = pq.read_table(tmp_path / "out" / f"date={DAYS[1]}" / "part-u1.parquet")
    assert table.schema.names == [*RESULT_SCHEMA.names, "id", "lang"]  # no `date`: it is the folder
    assert table.schema.field("id").type == pa.int64()
    assert table.column("idx").to_pylist() == list(range(1, 30, 3))  # idx order kept
    assert table.column("id").to_pylist() == [1000 + i for i in range(1, 30, 3)]


def test_duckdb_and_pyarrow_read_the_dataset_with_its_types(tmp_path):
    duckdb = pytest.importorskip("duckdb")
    root = resolve(str(tmp_path / "out"))
    write_partitioned(_rows(30), root, "parquet", partition_by=["date", "lang"], kept_schema=KEPT, unit="u1")
    # null lang -> pyarrow's fallback folder name, read back as null
    assert f"date={DAYS[0]}/lang=__HIVE_DEFAULT_PARTITION__/part-u1.parquet" in _files(tmp_path / "out")
    rel = duckdb.sql(f"SELECT idx, id, date, lang FROM read_parquet('{tmp_path}/out/**/*.parquet', "
                     "hive_partitioning = true, hive_types_autocast = true) ORDER BY idx")
    types = dict(zip(rel.columns, [str(t) for t in rel.types], strict=True))
    assert types["date"] == "DATE" and types["id"] == "BIGINT"
    rows = rel.fetchall()
    assert [r[0] for r in rows] == list(range(30))  # no row missing or doubled
    assert rows[4] == (4, 1004, DAYS[1], None) and rows[5] == (5, 1005, DAYS[2], "en")
    schema = pa.schema([pa.field("date", pa.date32()), pa.field("lang", pa.string())])
    table = pads.dataset(str(tmp_path / "out"), format="parquet",
                         partitioning=pads.partitioning(schema, flavor="hive")).to_table()
    assert table.num_rows == 30 and table.schema.field("date").type == pa.date32()


def test_a_rerun_replaces_and_a_stale_partition_goes(tmp_path):
    root = resolve(str(tmp_path / "out"))
    first = write_partitioned(_rows(30), root, "parquet", partition_by=["date"], kept_schema=KEPT, unit="u1")
    write_manifest(root.fs, root.path, Manifest("u1", "f1", "job-1", "in", [], first, "m", 1))
    # another unit's files share the folders and are never touched
    write_partitioned(_rows(3), root, "parquet", partition_by=["date"], kept_schema=KEPT, unit="u2")
    # the unit again, its input now without day 3: same names (replaced), day 3's file is stale
    again = write_partitioned(_rows(20, days=DAYS[:2]), root, "parquet", partition_by=["date"],
                              kept_schema=KEPT, unit="u1")
    previous = read_manifest(root.fs, root.path, "u1")
    assert delete_stale(root, previous, [o.path for o in again]) == [f"date={DAYS[2]}/part-u1.parquet"]
    assert _files(tmp_path / "out") == ["_manifests/u1.json", *[f"date={d}/part-{u}.parquet" for d in DAYS[:2]
                                                                for u in ("u1", "u2")],
                                        f"date={DAYS[2]}/part-u2.parquet"]
    ours = pads.dataset([str(tmp_path / "out" / o.path) for o in again], format="parquet").to_table()
    assert sorted(ours.column("idx").to_pylist()) == list(range(20))  # no duplicate of the first run
    # a manifest naming a path outside the root deletes nothing there
    evil = Manifest("u1", "f", "j", "in", [], [*first[:1]], None, 1)
    evil.outputs[0].path = "../victim.parquet"
    (tmp_path / "victim.parquet").write_text("x")
    assert delete_stale(root, evil, []) == [] and (tmp_path / "victim.parquet").exists()


def test_an_error_mid_write_leaves_nothing_visible(tmp_path):
    root = resolve(str(tmp_path / "out"))
    with pytest.raises(RuntimeError, match="broke"):
        write_partitioned(_rows(30, fail_at=17), root, "parquet", partition_by=["date"], kept_schema=KEPT,
                          unit="u1")
    assert not (tmp_path / "out").exists() or _files(tmp_path / "out") == []
    with pytest.raises(ValueError, match="more than 2 values"):
        write_partitioned(_rows(30), root, "parquet", partition_by=["date"], kept_schema=KEPT, unit="u1",
                          max_partitions=2)
    assert not (tmp_path / "out").exists() or _files(tmp_path / "out") == []


def test_bounded_buffers_still_write_every_row(tmp_path):
    root = resolve(str(tmp_path / "out"))
    # a budget of one byte: every converted batch is flushed at once as a row group of its own
    write_partitioned(_rows(600), root, "parquet", partition_by=["date"], kept_schema=KEPT, unit="u1",
                      memory_bytes=1)
    for day in DAYS:
        pf = pq.ParquetFile(tmp_path / "out" / f"date={day}" / "part-u1.parquet")
        assert pf.metadata.num_rows == 200 and pf.metadata.num_row_groups > 1
    table = pads.dataset(str(tmp_path / "out"), format="parquet", partitioning="hive").to_table()
    assert sorted(table.column("idx").to_pylist()) == list(range(600))


def test_jsonl_partitions_and_reading_back_through_the_manifest(tmp_path):
    root = resolve(str(tmp_path / "out"))
    outputs = write_partitioned(_rows(9), root, "jsonl", partition_by=["date"], kept_schema=KEPT, unit="u1")
    line = json.loads((tmp_path / "out" / f"date={DAYS[0]}" / "part-u1.jsonl").read_text().splitlines()[1])
    assert line["idx"] == 3 and line["id"] == 1003 and line["lang"] == "en" and "date" not in line
    assert KEPT_KEY not in line and SOURCE_KEY not in line
    write_manifest(root.fs, root.path, Manifest("u1", fingerprint([]), "job-1", "in", [], outputs, None, 1))
    back = list(manifest_rows(root.location, f"{root.location}/_manifests/u1.json", "job-1"))
    assert [r["idx"] for r in back] == list(range(9))  # merged back in idx order
    with pytest.raises(LookupError, match="replaced by job job-1"):
        list(manifest_rows(root.location, f"{root.location}/_manifests/u1.json", "job-0"))


def test_bad_partition_columns_are_refused(tmp_path):
    root = resolve(str(tmp_path / "out"))
    with pytest.raises(ValueError, match="not a kept column"):
        write_partitioned(_rows(3), root, "parquet", partition_by=["country"], kept_schema=KEPT, unit="u")
    nested = pa.schema([pa.field("tags", pa.list_(pa.string()))])
    with pytest.raises(ValueError, match="scalar column"):
        write_partitioned(iter(()), root, "parquet", partition_by=["tags"], kept_schema=nested, unit="u")
    with pytest.raises(ValueError, match="parquet or jsonl"):
        write_partitioned(iter(()), root, "openai", partition_by=["date"], kept_schema=KEPT, unit="u")


def test_on_s3_objects_appear_only_complete_and_reruns_replace(s3_server, monkeypatch):
    for k, v in s3_server.env().items():
        monkeypatch.setenv(k, v)
    s3_server.make_bucket("partitioned")  # a bucket of this test's own: the server serves the session

    def objects() -> list[str]:  # what a reader of the bucket sees (pyarrow's folder markers aside)
        return sorted(k for k in s3_server.object_keys("partitioned") if not k.endswith("/"))

    root = resolve("s3://partitioned/enriched")
    with pytest.raises(RuntimeError, match="broke"):
        write_partitioned(_rows(30, fail_at=20), root, "parquet", partition_by=["date"], kept_schema=KEPT,
                          unit="u1")
    assert objects() == []  # nothing half written, no temporary object left
    first = write_partitioned(_rows(30), root, "parquet", partition_by=["date"], kept_schema=KEPT, unit="u1")
    write_manifest(root.fs, root.path, Manifest("u1", "f", "job-1", "in", [], first, None, 1))
    assert objects() == ["enriched/_manifests/u1.json",
                         *[f"enriched/date={d}/part-u1.parquet" for d in DAYS]]
    again = write_partitioned(_rows(12, days=DAYS[:2]), root, "parquet", partition_by=["date"],
                              kept_schema=KEPT, unit="u1")
    delete_stale(root, read_manifest(root.fs, root.path, "u1"), [o.path for o in again])
    write_manifest(root.fs, root.path, Manifest("u1", "f", "job-2", "in", [], again, None, 2))
    assert objects() == ["enriched/_manifests/u1.json",
                         *[f"enriched/date={d}/part-u1.parquet" for d in DAYS[:2]]]
    table = pads.dataset(root.path, filesystem=root.fs, format="parquet", partitioning="hive").to_table()
    assert sorted(table.column("idx").to_pylist()) == list(range(12))  # replaced, not added to


def test_the_nightly_direct_export_writes_through_it_with_a_manifest_per_run(redis_server, tmp_path,
                                                                            monkeypatch):
    from batchinfer.datasets.manifest import read_manifests
    from batchinfer.jobs import nightly
    from batchinfer.keys import DIRECT, Keys

    monkeypatch.setenv("BATCHINFER_RESULTS_ROOT", str(tmp_path))
    r = redis_server.client()
    day1 = int(dt.datetime(2024, 5, 1, 12, tzinfo=dt.timezone.utc).timestamp() * 1000)
    for n, ms in enumerate([day1, day1 + 1, day1 + nightly.DAY_MS]):
        row = {"job_id": None, "request_id": f"d{n}", "status": "completed", "output_text": str(n)}
        r.xadd(Keys("{n}").results(DIRECT), {"row": json.dumps(row)}, id=f"{ms}-0")
    until = day1 + 2 * nightly.DAY_MS
    written = nightly.export_direct(prefix="{n}", until_ms=until, redis_url=redis_server.url)
    root = tmp_path / "direct"
    assert written == [str(root / f"date=2024-05-0{d}" / f"part-0-{until}.parquet") for d in (1, 2)]
    manifests = read_manifests(resolve(str(root)).fs, str(root))
    assert list(manifests) == [f"direct-0-{until}"]
    run = manifests[f"direct-0-{until}"]
    assert [(o.path, o.partition, o.rows) for o in run.outputs] == [
        (f"date=2024-05-01/part-0-{until}.parquet", {"date": "2024-05-01"}, 2),
        (f"date=2024-05-02/part-0-{until}.parquet", {"date": "2024-05-02"}, 1)]
    assert pq.read_table(written[0]).schema.equals(nightly.DIRECT_FILE_SCHEMA)  # no `date` in the files


def test_a_writer_that_died_mid_move_leaves_a_temporary_file_the_next_write_sweeps(tmp_path):
    import os

    root = resolve(str(tmp_path / "out"))
    write_partitioned(_rows(4, days=DAYS[:1]), root, "parquet", partition_by=["date"], kept_schema=KEPT,
                      unit="u1")
    folder = tmp_path / "out" / f"date={DAYS[0]}"
    # what a writer killed between its upload and its move leaves: a complete, hidden temporary file
    old, fresh = folder / ".part-u1.parquet.0123456789ab.tmp", folder / ".part-u1.parquet.ba9876543210.tmp"
    other = folder / ".part-u2.parquet.0123456789ab.tmp"  # another unit's file: not this write's
    for path in (old, fresh, other):
        path.write_bytes(b"PAR1")
    for path in (old, other):
        os.utime(path, (0, 0))  # long ago
    write_partitioned(_rows(4, days=DAYS[:1]), root, "parquet", partition_by=["date"], kept_schema=KEPT,
                      unit="u1")
    # the dead writer's old file went; a live writer's recent one and another file's stay
    assert not old.exists() and fresh.exists() and other.exists()
    assert pq.read_table(folder / "part-u1.parquet").num_rows == 4
